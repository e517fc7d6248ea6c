"""Long-context decode end to end, bf16 cache vs FP8 (e4m3) cache, in one process: two
engines built once, the same prompts prefilled in each (alternately), then their decode steps
alternated one by one (A, B, A, B, ...), so that machine load and drift hit both alike.
Prints each cache's median prefill time and median / mean decode step, and bf16 / fp8.

    python benchmarks/fp8_kv_decode_ab.py --model benchmarks/checkpoints/qwen2-0.5b-shape \\
        --context 4096 --batch-size 1 --output-len 128 --threads 2 --num-iters 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind

CACHES = {"bf16": "auto", "fp8": "fp8"}


def prefill(engine, prompts: list[list[int]], params: SamplingParams, tag: str) -> float:
    """Add the prompts and step until each has its first token; seconds taken."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(out.request_id for out in engine.step() if out.outputs and out.outputs[0].token_ids)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="benchmarks/checkpoints/qwen2-0.5b-shape")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    max_len = args.context + args.output_len
    engines = {
        name: LLM(model=args.model, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_model_len=max_len,
                  max_num_seqs=args.batch_size, max_num_batched_tokens=max(max_len, 2048)).llm_engine
        for name, kv_cache_dtype in CACHES.items()
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    prefills: dict[str, list[float]] = {name: [] for name in engines}
    steps: dict[str, list[float]] = {name: [] for name in engines}
    for it in range(args.num_iters):
        gen = torch.Generator().manual_seed(it)
        prompts = [torch.randint(100, 30000, (args.context,), generator=gen).tolist() for _ in range(args.batch_size)]
        for name, engine in engines.items():
            engine.reset_prefix_cache()
            prefills[name].append(prefill(engine, prompts, params, f"{it}"))
        while any(engine.has_unfinished_requests() for engine in engines.values()):
            for name, engine in engines.items():
                if engine.has_unfinished_requests():
                    start = time.perf_counter()
                    engine.step()
                    steps[name].append((time.perf_counter() - start) * 1e3)
    for name in engines:
        print(f"{name}: prefill median {statistics.median(prefills[name]):.2f} s; decode step median "
              f"{statistics.median(steps[name]):.2f} ms, mean {statistics.mean(steps[name]):.2f} ms")
    print(f"bf16 / fp8 time: prefill {statistics.median(prefills['bf16']) / statistics.median(prefills['fp8']):.3f}x, "
          f"decode median {statistics.median(steps['bf16']) / statistics.median(steps['fp8']):.3f}x, "
          f"mean {statistics.mean(steps['bf16']) / statistics.mean(steps['fp8']):.3f}x (> 1: fp8 faster)")


if __name__ == "__main__":
    main()
