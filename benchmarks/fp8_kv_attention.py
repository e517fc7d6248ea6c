"""The paged decode-attention kernel over a bfloat16 cache vs FP8 (e4m3, e5m2) caches, in one
process, alternated call by call so that machine load hits all three alike.

Shape: the 0.5B shape's attention (14 query heads, 2 KV heads, head_dim 64, block size 16),
bfloat16 queries, every request at ``--context`` tokens. A "step" calls the kernel once per
layer, each layer with its own cache (``--layers``, as a decode step does: 24 layers x 4k
tokens is 48 MB of bf16 cache per request, past the L2); blocks are shuffled over the cache.
Prints the median and the minimum ms per layer call of each cache dtype and bf16 / fp8.

    python benchmarks/fp8_kv_attention.py --threads 2 --batch-sizes 1 8
    PAGEDLLM_CPU_ISA=avx2 python benchmarks/fp8_kv_attention.py   # another ISA level
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.kernels import cpu as kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 14, 2, 64, 16


def measure(batch: int, context: int, layers: int, reps: int) -> dict[str, list[float]]:
    """ms per layer call of each cache dtype, one entry per repetition."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = batch * context // BLOCK_SIZE
    bf16 = [torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
            for _ in range(layers)]
    caches = {"bf16": bf16,
              "fp8_e4m3": [c.float().to(torch.float8_e4m3fn) for c in bf16],
              "fp8_e5m2": [c.float().to(torch.float8_e5m2) for c in bf16]}
    table = torch.randperm(num_blocks, generator=gen).view(batch, context // BLOCK_SIZE)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).bfloat16()
    out = torch.empty_like(query)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(reps):
        for name, per_layer in caches.items():
            start = time.perf_counter()
            for cache in per_layer:
                kernels.paged_decode_attention(out, query, cache[0], cache[1], table, seq_lens, HEAD_DIM ** -0.5)
            times[name].append((time.perf_counter() - start) / layers * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernels: {kernels.build_info()}; threads {args.threads}, context {args.context}, layers {args.layers}")
    for batch in args.batch_sizes:
        times = measure(batch, args.context, args.layers, args.reps)
        for label, stat in (("median", statistics.median), ("min", min)):
            ms = {name: stat(values) for name, values in times.items()}
            ratios = ", ".join(f"bf16/{name} {ms['bf16'] / ms[name]:.2f}x" for name in ms if name != "bf16")
            print(f"batch {batch} {label}: " + ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items())
                  + f"; {ratios}", flush=True)


if __name__ == "__main__":
    main()
