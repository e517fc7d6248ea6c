"""The CPU_ATTN backend's step over a bfloat16 cache vs FP8 (e4m3, e5m2) caches, in one
process, alternated step by step so that machine load hits all three alike.

Shape: the 0.5B shape's attention (14 query heads, 2 KV heads, head_dim 64, block size 16),
bfloat16 queries, every request at ``--context`` tokens. A "step" builds the step's metadata
once and calls the backend once per layer (the cache write, quantizing for FP8, and the
attention kernel), each layer with its own cache (``--layers``, as a model step does: 24
layers x 4k tokens is 48 MB of bf16 cache per request, past the L2); blocks are shuffled over
the cache. Decode steps: ``--batch-sizes`` requests, one new token each. Prefill steps
(``--prefill-chunk N``): one request's last N prompt tokens after ``context - N`` cached.
Prints the median and the minimum ms per layer of each cache dtype and bf16 / fp8.

    python benchmarks/fp8_kv_attention.py --threads 2 --batch-sizes 1 8
    python benchmarks/fp8_kv_attention.py --threads 2 --batch-sizes --prefill-chunk 512 --reps 5
    PAGEDLLM_CPU_ISA=avx2 python benchmarks/fp8_kv_attention.py   # another ISA level
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
import torch

from pagedllm.attention import selector
from pagedllm.attention.backends.abstract import CommonAttentionMetadata
from pagedllm.attention.kv_cache_quant import quantize
from pagedllm.kernels import cpu as kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 14, 2, 64, 16
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class _Layer:
    """Stands in for the ``Attention`` layer: its FP8 scales."""

    k_scale_float = v_scale_float = 0.05


def _common(batch: int, context: int, query_len: int, gen: torch.Generator) -> CommonAttentionMetadata:
    """``batch`` requests of ``context`` tokens (this step's ``query_len`` last ones new), on
    shuffled blocks."""
    blocks_per_req = -(-context // BLOCK_SIZE)
    table = torch.randperm(batch * blocks_per_req, generator=gen).view(batch, blocks_per_req).numpy()
    positions = np.arange(context - query_len, context)
    slots = (table[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).reshape(-1)
    return CommonAttentionMetadata(
        query_start_loc=np.arange(batch + 1) * query_len,
        seq_lens=np.full(batch, context),
        num_computed_tokens=np.full(batch, context - query_len),
        block_table=table,
        slot_mapping=slots,
        num_decodes=batch if query_len == 1 else 0,
    )


def measure(batch: int, context: int, query_len: int, layers: int, reps: int) -> dict[str, list[float]]:
    """ms per layer of each cache dtype's step, one entry per repetition."""
    gen = torch.Generator().manual_seed(0)
    common = _common(batch, context, query_len, gen)
    num_blocks = common.block_table.size
    bf16 = [torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
            for _ in range(layers)]
    layer = _Layer()
    num_tokens = batch * query_len
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).bfloat16()
    key, value = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for _ in range(2))
    steps: dict[str, Callable[[], None]] = {}
    for name, dtype in CACHE_DTYPES.items():
        caches = bf16 if dtype == torch.bfloat16 else [quantize(c, layer.k_scale_float, dtype) for c in bf16]
        kv_cache_dtype = "auto" if dtype == torch.bfloat16 else "fp8" if dtype == torch.float8_e4m3fn else "fp8_e5m2"
        backend = selector.get_attn_backend(HEAD_DIM, torch.bfloat16, BLOCK_SIZE, "CPU_ATTN", kv_cache_dtype=kv_cache_dtype)
        builder = backend.get_builder_cls()(BLOCK_SIZE, torch.device("cpu"))
        impl = backend.get_impl_cls()(NUM_HEADS, HEAD_DIM, HEAD_DIM**-0.5, NUM_KV_HEADS)

        def step(caches=caches, builder=builder, impl=impl) -> None:
            metadata = builder.build(common)
            for cache in caches:
                impl.forward(layer, query, key, value, cache, metadata)

        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - start) / layers * 1e3)
    return times


def report(label: str, times: dict[str, list[float]]) -> None:
    """Median and minimum of each dtype, and bf16 / fp8."""
    for stat_name, stat in (("median", statistics.median), ("min", min)):
        ms = {name: stat(values) for name, values in times.items()}
        ratios = ", ".join(f"bf16/{name} {ms['bf16'] / ms[name]:.2f}x" for name in ms if name != "bf16")
        print(f"{label} {stat_name}: " + ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items()) + f"; {ratios}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--prefill-chunk", type=int, default=0, help="also time one request's prefill chunk of this many tokens")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernels: {kernels.build_info()}; threads {args.threads}, context {args.context}, layers {args.layers}")
    for batch in args.batch_sizes:
        report(f"decode batch {batch}", measure(batch, args.context, 1, args.layers, args.reps))
    if args.prefill_chunk:
        report(f"prefill chunk {args.prefill_chunk}", measure(1, args.context, args.prefill_chunk, args.layers, args.reps))


if __name__ == "__main__":
    main()
