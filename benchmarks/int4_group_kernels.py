"""Decode matmuls of the 0.5B shape on ``--quantization int4`` weights: groups of 32 (the
default) against groups of 128 (``--quantization-config '{"group_size": 128}'``) and the bf16
layer, interleaved A, B, C, A, B, C ... in one process so that machine load cancels out; prints
the median time of each per shape and the ratios g32 / g128 and g32 / bf16 (> 1: g32 slower).

    PYTHONPATH=. python benchmarks/int4_group_kernels.py [--rows 1] [--repeats 15] [--isa avx2] [--threads 1] [--cpu-time]

The int4 weights are quantized from the same random bf16 weights as the bf16 layer
(``quantize_int4_per_group``, stored as ``--quantization int4`` stores them: float16 scales in
``pack_groups``' blocks, no zero points; ``--float32-scales``: float32 [N, G] scales and zero
points, the storage before) and run on
``linear_w4`` with the engine's default int8 activations (``--float-activations``: float32 ones).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers import cpu_gemm
from pagedllm.model_executor.layers.quantization.grouped import compact_scales
from pagedllm.model_executor.layers.quantization.int4 import quantize_int4_per_group

# The sibling script (this folder is sys.path[0] when run as ``python benchmarks/...``).
from int8_activation_kernels import SHAPES, kernel_parser, run_at_isa  # noqa: E402  isort: skip


def main() -> None:
    parser = kernel_parser(__doc__.splitlines()[0])
    parser.add_argument("--cpu-time", action="store_true", help="time this thread's CPU time (use with --threads 1)")
    parser.add_argument("--float-activations", action="store_true", help="float32 activations, not int8")
    parser.add_argument("--float32-scales", action="store_true",
                        help="float32 scales and zero points, not the engine's float16 scales without zeros")
    run_at_isa(parser.parse_args(), _run)


def _run(args: argparse.Namespace) -> None:
    clock = time.thread_time if args.cpu_time else time.perf_counter
    int8_x = not args.float_activations

    def timed(fn) -> float:
        start = clock()
        for _ in range(args.calls):
            fn()
        return (clock() - start) / args.calls

    print(f"kernels {cpu_kernels.build_info()}, {torch.get_num_threads()} threads, {args.rows} row(s), "
          f"{'int8' if int8_x else 'float32'} activations")
    print(f"{'shape':8} {'N x K':>12} {'bf16 us':>8} {'g128 us':>8} {'g32 us':>8} {'g32/g128':>9} {'g32/bf16':>9}")
    for shape, n, k in SHAPES:
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        packed16 = cpu_gemm.pack_weight(w) if cpu_gemm.can_pack(w) else w
        variants = {"bf16": lambda x, p=packed16: cpu_gemm.linear(x, p)}
        for group in (128, 32):
            q, scale, zero = quantize_int4_per_group(w, group)
            packed = cpu_kernels.pack_w4(q)
            if not args.float32_scales:
                scale, zero = compact_scales(scale, zero, 4)
                scale = cpu_kernels.pack_groups(scale)
            variants[f"g{group}"] = lambda x, p=packed, s=scale, z=zero: cpu_kernels.linear_w4(x, p, s, z, None, n, int8_x)
        x = torch.randn(args.rows, k, dtype=torch.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():
            fn(x)  # warm-up (oneDNN primitive creation)
        for _ in range(args.repeats):
            for name, fn in variants.items():
                times[name].append(timed(lambda: fn(x)))
        med = {name: statistics.median(t) for name, t in times.items()}
        vs128 = statistics.median(a / b for a, b in zip(times["g32"], times["g128"]))
        vs16 = statistics.median(a / b for a, b in zip(times["g32"], times["bf16"]))
        print(f"{shape:8} {n:>5} x {k:<5} {med['bf16'] * 1e6:>8.1f} {med['g128'] * 1e6:>8.1f} {med['g32'] * 1e6:>8.1f} "
              f"{vs128:>8.2f}x {vs16:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
