"""Image requests on pagedllm against transformers on the same Qwen2.5-VL-shaped model:
throughput and time to first token (TTFT), the encoder's share of a prefill step, and the
TTFT of a repeated image (encoder-cache and prefix-cache hit), in one table.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/vlm_images.py --model benchmarks/checkpoints/qwen2.5-vl-3b-cut

The model is ``benchmarks/make_checkpoint.py``'s ``qwen2.5-vl-3b-cut`` preset, written into
``--model`` when that folder has no config.json: a random Qwen2_5_VLForConditionalGeneration
that transformers writes, with Qwen2.5-VL-3B's per-layer shapes but 4 of its 32 vision blocks
and 4 of its 36 language-model layers (so the whole run takes minutes on 2 cores), a
32000-token vocabulary, images of at most 448 x 448 pixels; weights in ``--dtype`` (bfloat16:
both sides run it on CPU).

Each request is one random ``--image-size`` square image (448: 256 embeddings) followed by
``--text-tokens`` (64) text tokens of random one-token words, and asks for ``--output-len``
(64) tokens, greedy, EOS ignored (``ignore_eos`` / ``min_new_tokens``). Both sides get the
same token ids (checked) and run in this process with the same torch threads:

- throughput: ``--num-requests`` (16) requests in one call, ``LLM.generate`` against
  transformers' ``generate`` on the processor's batch (left padding); requests/s and output
  tokens/s, median of ``--rounds`` rounds alternated (A B, B A, ...), fresh images each round.
- TTFT at batch 1, cold (a fresh image each round: no encoder-cache entry, no prefix hit):
  the wall time of ``LLM.generate`` with ``max_tokens=1`` (offline; the front end's image
  processing and hashing, the encoder, the prefill and the first token) against transformers'
  processor call plus ``generate(max_new_tokens=1)``; median of ``--ttft-rounds``.
- TTFT warm: the same image and text sent to pagedllm again right after (encoder-cache and
  prefix-cache hit: all but the last prompt token served from the cache), cold beside it.
- the encoder's share: wall-clock hooks, set on this process's model runner instance only,
  around ``ModelRunner.execute_model`` (the whole step) and the model's
  ``get_multimodal_embeddings`` (the vision tower and the merger), the device synchronized
  before each reading; the share of the cold batch-1 prefill step (median), and of all the
  steps of the throughput rounds together.
- correctness: the warm-up batch's first request, greedy, on both sides in ``--check-dtype``
  (float32, on a fresh engine and model freed after: the script fails unless the tokens are
  equal) and in ``--dtype`` (printed only: the random model's top two logprobs are often within
  0.1 nat, and each side's bfloat16 logprobs are 0.1-0.2 nat off float32's, so the two sides
  may part at any token).

Prints the machine (CPU, ISA, threads, load average before and after), each round, and a
markdown table (rows ``| metric | pagedllm | transformers | pagedllm / transformers |``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

# tests/ is in the checkout, not in the package.
sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks import make_checkpoint  # noqa: E402
from tests.multimodal.checkpoints import hf_qwen_vl_processor, random_image  # noqa: E402

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def ensure_checkpoint(path: Path, preset: str, dtype: str) -> Path:
    """``path``, after writing ``make_checkpoint``'s ``preset`` there in ``dtype`` if it has no config.json."""
    if not (path / "config.json").is_file():
        make_checkpoint.main(["--preset", preset, "--out", str(path), "--dtype", dtype])
    return path


def one_token_words(tokenizer) -> list[str]:
    """The vocabulary's tokens that are a space and letters and encode back to themselves alone."""
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if len(text) > 2 and text[0] == " " and text[1:].isalpha() and tokenizer.encode(text) == [token_id]:
            words.append(text)
    return words


def make_requests(words: list[str], num: int, image_size: int, text_tokens: int, seed: int) -> list[tuple]:
    """``num`` (prompt text, PIL image) pairs: the image placeholder then ``text_tokens`` random
    words, and a random ``image_size`` square image, both drawn from ``seed``."""
    rng = random.Random(seed)
    return [(IMAGE + "".join(rng.choice(words) for _ in range(text_tokens)),
             random_image(image_size, image_size, seed=seed * 1000 + i)) for i in range(num)]


class StepTimer:
    """Wall-clock hooks on one model runner (instance attributes: the class and any other
    runner are untouched): ``steps`` collects (step seconds, encoder seconds) per
    ``execute_model`` call, encoder seconds being the time in ``get_multimodal_embeddings``."""

    def __init__(self, runner, synchronize: Callable[[], None]):
        self.steps: list[tuple[float, float]] = []
        self._encoder = 0.0
        step, encode = runner.execute_model, runner.model.get_multimodal_embeddings

        def timed_step(so):
            self._encoder = 0.0
            synchronize()
            start = time.perf_counter()
            out = step(so)
            synchronize()
            self.steps.append((time.perf_counter() - start, self._encoder))
            return out

        def timed_encode(**inputs):
            synchronize()
            start = time.perf_counter()
            out = encode(**inputs)
            synchronize()
            self._encoder += time.perf_counter() - start
            return out

        runner.execute_model, runner.model.get_multimodal_embeddings = timed_step, timed_encode

    def take(self) -> list[tuple[float, float]]:
        """The steps since the last ``take``."""
        steps, self.steps = self.steps, []
        return steps


class HFSide:
    """transformers' processor and model of the checkpoint in ``dtype``."""

    def __init__(self, path: Path, dtype: torch.dtype):
        from transformers import Qwen2_5_VLForConditionalGeneration

        self.processor = hf_qwen_vl_processor(path)
        self.processor.tokenizer.padding_side = "left"
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()

    def inputs(self, requests: list[tuple]) -> dict:
        return self.processor(text=[text for text, _ in requests], images=[image for _, image in requests],
                              padding=True, return_tensors="pt")

    @torch.inference_mode()
    def generate(self, requests: list[tuple], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions of ``requests`` in one batch, exactly ``max_new_tokens`` each."""
        inputs = self.inputs(requests)
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                  do_sample=False)
        return out[:, inputs["input_ids"].shape[1]:].tolist()


def check_prompt(prompt_token_ids: list[int], hf: HFSide, request: tuple) -> int:
    """The length of pagedllm's ``prompt_token_ids`` of ``request``, after checking that
    transformers' processor gives the same ids.

    Raises:
        SystemExit: the two sides' prompt token ids differ.
    """
    theirs = hf.inputs([request])["input_ids"][0].tolist()
    if prompt_token_ids != theirs:
        raise SystemExit(f"the two sides tokenized the first prompt differently ({len(prompt_token_ids)} and "
                         f"{len(theirs)} tokens)")
    return len(theirs)


def greedy_check(path: Path, dtype: str, request: tuple, output_len: int) -> tuple[list[int], list[int]]:
    """pagedllm's and transformers' greedy tokens for ``request`` in ``dtype``, on a fresh engine
    and model that are freed after."""
    from pagedllm import LLM

    llm = LLM(str(path), dtype=dtype, max_model_len=2048, kv_cache_memory_bytes=1 << 28)
    ours = list(pagedllm_generate(llm, [request], output_len)[0].outputs[0].token_ids)
    del llm
    gc.collect()
    hf = HFSide(path, make_checkpoint.DTYPES[dtype])
    theirs = hf.generate([request], output_len)[0]
    del hf
    gc.collect()
    return ours, theirs


def pagedllm_generate(llm, requests: list[tuple], max_tokens: int) -> list:
    from pagedllm import SamplingParams

    prompts = [{"prompt": text, "multi_modal_data": {"image": [image]}} for text, image in requests]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    return f"{cpu}, {os.cpu_count()} logical CPUs"


def _first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where ``a`` and ``b`` differ; their common length if none."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> dict[str, list[str]]:
    """Run the benchmark (module docstring); returns the table's rows, metric -> cells."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("benchmarks/checkpoints/qwen2.5-vl-3b-cut"))
    parser.add_argument("--preset", default="qwen2.5-vl-3b-cut", choices=sorted(make_checkpoint.PRESETS),
                        help="the make_checkpoint preset written into --model when it is missing")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(make_checkpoint.DTYPES))
    parser.add_argument("--check-dtype", default="float32", choices=sorted(make_checkpoint.DTYPES),
                        help="the dtype of the greedy check (float32: the two sides' tokens must be equal)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from pagedllm import LLM
    from pagedllm.kernels import isa
    from pagedllm.platforms import current_platform

    path = ensure_checkpoint(args.model, args.preset, args.dtype)
    load_before = os.getloadavg()
    llm = LLM(str(path), dtype=args.dtype, enable_prefix_caching=True, max_num_seqs=max(args.num_requests, 1),
              max_model_len=2048, kv_cache_memory_bytes=1 << 30, seed=args.seed)
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    timer = StepTimer(runner, current_platform.synchronize)
    hf = HFSide(path, make_checkpoint.DTYPES[args.dtype])
    words = one_token_words(hf.processor.tokenizer)
    seeds = iter(range(args.seed * 100_000 + 1, 1 << 62))
    batch = functools.partial(make_requests, words, image_size=args.image_size, text_tokens=args.text_tokens)

    # Warm-up and correctness: one batch on each side; the first request's greedy tokens in
    # --check-dtype (fresh sides unless it is --dtype) and in --dtype.
    warm_up = batch(args.num_requests, seed=next(seeds))
    outputs = pagedllm_generate(llm, warm_up, args.output_len)
    ours, theirs = [list(o.outputs[0].token_ids) for o in outputs], hf.generate(warm_up, args.output_len)
    prompt_len = check_prompt(outputs[0].prompt_token_ids, hf, warm_up[0])
    check = (ours[0], theirs[0]) if args.check_dtype == args.dtype else None
    timer.take()
    if check is None:
        check = greedy_check(path, args.check_dtype, warm_up[0], args.output_len)
    print(f"greedy check, first request ({prompt_len} prompt tokens), {args.check_dtype}: pagedllm {check[0]}")
    print(f"greedy check, first request, {args.check_dtype}: transformers {check[1]}")
    print(f"first request greedy tokens equal in {args.check_dtype}: {check[0] == check[1]} "
          f"({_first_difference(*check)} of {args.output_len} tokens before the first difference)")
    if args.check_dtype != args.dtype:
        print(f"in {args.dtype} (the timed runs): {_first_difference(ours[0], theirs[0])} of {args.output_len} "
              f"tokens equal before the first difference (rounding of random weights)", flush=True)

    # Throughput: alternated rounds, fresh images each round, both sides on the same requests.
    rates: dict[str, list[float]] = {"pagedllm": [], "transformers": []}
    steps = []
    for i in range(args.rounds):
        requests = batch(args.num_requests, seed=next(seeds))
        sides = {"pagedllm": lambda: pagedllm_generate(llm, requests, args.output_len),
                 "transformers": lambda: hf.generate(requests, args.output_len)}
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            elapsed, _ = _timed(sides[name])
            if name == "pagedllm":
                steps += timer.take()
            rates[name].append(len(requests) / elapsed)
            print(f"round {i + 1} {name}: {rates[name][-1]:.3f} requests/s", flush=True)

    # TTFT at batch 1: a fresh image each round (cold); pagedllm again on the same request (warm).
    ttft: dict[str, list[float]] = {"pagedllm": [], "transformers": [], "warm": []}
    shares = []
    for i in range(args.ttft_rounds):
        request = batch(1, seed=next(seeds))
        for name in (["pagedllm", "transformers"] if i % 2 == 0 else ["transformers", "pagedllm"]):
            if name == "transformers":
                ttft[name].append(_timed(lambda: hf.generate(request, 1))[0])
                continue
            elapsed, (cold,) = _timed(lambda: pagedllm_generate(llm, request, 1))
            prefill = [(step, enc) for step, enc in timer.take() if enc > 0]
            assert cold.num_cached_tokens == 0 and len(prefill) == 1, "the cold request hit a cache or took 2 steps"
            shares.append(prefill[0][1] / prefill[0][0])
            ttft[name].append(elapsed)
            elapsed, (warm,) = _timed(lambda: pagedllm_generate(llm, request, 1))
            assert warm.num_cached_tokens > 0 and not any(enc for _, enc in timer.take()), "the repeat missed a cache"
            ttft["warm"].append(elapsed)
        print(f"TTFT round {i + 1}: pagedllm cold {ttft['pagedllm'][-1]:.3f} s, warm {ttft['warm'][-1]:.3f} s, "
              f"transformers {ttft['transformers'][-1]:.3f} s; encoder {100 * shares[-1]:.0f}% of the prefill step",
              flush=True)

    rate = [statistics.median(rates[name]) for name in ("pagedllm", "transformers")]
    cold = [statistics.median(ttft[name]) for name in ("pagedllm", "transformers")]
    run_share = sum(enc for _, enc in steps) / sum(step for step, _ in steps)
    rows = {
        "throughput, requests/s": [f"{r:.3f}" for r in rate] + [f"{rate[0] / rate[1]:.2f}"],
        "throughput, output tokens/s": [f"{r * args.output_len:.1f}" for r in rate] + [f"{rate[0] / rate[1]:.2f}"],
        "TTFT batch 1, cold image, s": [f"{t:.3f}" for t in cold] + [f"{cold[0] / cold[1]:.2f}"],
        "TTFT batch 1, the same image and text again, s": [
            f"{statistics.median(ttft['warm']):.3f} (cold {cold[0]:.3f})", "-", "-"],
        "encoder share of the cold batch-1 prefill step": [f"{100 * statistics.median(shares):.0f}%", "-", "-"],
        "encoder share of the throughput rounds' steps": [f"{100 * run_share:.0f}%", "-", "-"],
    }
    load_after = os.getloadavg()
    config = hf.model.config
    print(f"machine: {_machine()}; ISA {isa.selected_isa()}; torch threads {torch.get_num_threads()}; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"model: {path}, {args.preset} preset ({config.architectures[0]}: {config.vision_config.depth} vision "
          f"blocks of {config.vision_config.hidden_size}, {config.text_config.num_hidden_layers} language-model "
          f"layers of {config.text_config.hidden_size}, vocab {config.text_config.vocab_size}), {args.dtype}")
    print(f"workload: {args.num_requests} requests of one {args.image_size}x{args.image_size} image + "
          f"{args.text_tokens} text tokens ({prompt_len} prompt tokens), {args.output_len} tokens out, greedy, "
          f"EOS ignored; throughput median of {args.rounds} alternated rounds, TTFT of {args.ttft_rounds}")
    print()
    print("| metric | pagedllm | transformers | pagedllm / transformers |")
    print("| --- | --- | --- | --- |")
    for metric, cells in rows.items():
        print(f"| {metric} | " + " | ".join(cells) + " |")
    if check[0] != check[1]:
        raise SystemExit(f"pagedllm's greedy tokens differ from transformers' in {args.check_dtype}")
    return rows


if __name__ == "__main__":
    main()
