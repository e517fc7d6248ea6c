"""Embeddings/s of pagedllm (``LLM.embed``) against sentence-transformers (``encode``) on the
same encoder, alternated in one process (A, B, B, A ..., median of ``--rounds``), so a loaded
machine's noise falls on both alike.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/embeddings.py --out /tmp/bert-base-st

The encoder is a random BERT-base-shape ``BertModel`` (hidden 768, 12 layers, 12 heads, FFN
3072, 512 positions, a 30522-token WordPiece vocabulary of words, letters and unused
entries) in a sentence-transformers folder (MEAN pooling, Normalize) written with
sentence-transformers' API into ``--out`` (kept: a second run reuses it). The batch is
``--num-sentences`` sentences of random words, each ``--tokens`` tokens with [CLS] / [SEP].
Both sides get the whole batch in one call, in ``--dtype`` (float32: sentence-transformers'
CPU default), with the same torch threads; sentence-transformers batches it by its own
``batch_size`` (``--st-batch-size``, its default 32). Prints the machine (CPU, ISA, threads,
load average before and after), embeddings/s of each round, the medians and their ratio, and
the largest difference of the two sides' embeddings (a check that both compute the same).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

#: Words of the vocabulary (each one token) and of the sentences.
_WORDS = ("the a of and to in is it that for on with as was he she they be this are at by from or an have not "
          "hello world cat dog run fast slow good bad house tree river city model token cache block query "
          "document answer search result value small large first last next time day year way people").split()
_VOCAB_SIZE = 30522


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
    vocab += [f"[unused{i}]" for i in range(_VOCAB_SIZE - len(vocab))]
    (raw / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(str(raw / "vocab.txt"))
    tokenizer.save_pretrained(raw)
    config = transformers.BertConfig(vocab_size=_VOCAB_SIZE, hidden_size=768, num_hidden_layers=num_layers,
                                     num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512,
                                     pad_token_id=0)
    torch.manual_seed(seed)
    transformers.BertModel(config).eval().save_pretrained(raw)
    transformer = models.Transformer(str(raw))
    modules = [transformer, models.Pooling(768, pooling_mode="mean"), models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def sentences(num: int, num_tokens: int, seed: int) -> list[str]:
    """``num`` sentences of random words, ``num_tokens`` tokens each with [CLS] and [SEP]."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(num_tokens - 2)) for _ in range(num)]


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    return f"{cpu}, {os.cpu_count()} logical CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bert-base-st"))
    parser.add_argument("--num-sentences", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-hidden-layers", type=int, default=12)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM
    from pagedllm.kernels import isa

    path = write_encoder(args.out, args.num_hidden_layers, args.seed)
    batch = sentences(args.num_sentences, args.tokens, args.seed)
    load_before = os.getloadavg()
    llm = LLM(str(path), dtype=args.dtype, kv_cache_memory_bytes=1 << 30, max_num_seqs=args.num_sentences)
    st = SentenceTransformer(str(path), device="cpu").to(getattr(torch, args.dtype))
    assert all(len(ids) == args.tokens for ids in llm.get_tokenizer()(batch)["input_ids"])

    def pagedllm_embed() -> torch.Tensor:
        return torch.tensor([out.outputs.embedding for out in llm.embed(batch, use_tqdm=False)])

    def st_encode() -> torch.Tensor:
        return st.encode(batch, batch_size=args.st_batch_size, convert_to_tensor=True).float()

    sides = {"pagedllm": pagedllm_embed, "sentence-transformers": st_encode}
    last = {name: fn() for name, fn in sides.items()}  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.rounds):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            start = time.perf_counter()
            last[name] = sides[name]()
            rates[name].append(len(batch) / (time.perf_counter() - start))
            print(f"round {i + 1} {name}: {rates[name][-1]:.1f} embeddings/s", flush=True)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    print(f"machine: {_machine()}; ISA {isa.selected_isa()}; torch threads {torch.get_num_threads()}; "
          f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{len(batch)} sentences x {args.tokens} tokens, {args.num_hidden_layers} layers, {args.dtype}; "
          f"median of {args.rounds}: " + ", ".join(f"{name} {m:.1f}/s" for name, m in medians.items()))
    print(f"ratio pagedllm / sentence-transformers: {medians['pagedllm'] / medians['sentence-transformers']:.2f}")
    print(f"max |difference| of the embeddings: {(last['pagedllm'] - last['sentence-transformers']).abs().max():.2e}")


if __name__ == "__main__":
    main()
