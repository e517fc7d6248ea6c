"""Decode matmuls of the 0.5B shape on GGUF-style Q8_0 / Q4_0 weights (groups of 32): the
float32-activation kernels against the int8-activation ones (``linear_w8g`` / ``linear_w4``
with ``int8_activations``), interleaved A, B, A, B in one process so that machine load cancels
out; prints the median time of each and their ratio per shape.

    PYTHONPATH=. python benchmarks/int8_activation_kernels.py [--rows 1] [--repeats 15] [--isa avx2] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from pagedllm.kernels import cpu as cpu_kernels

#: (name, N outputs, K inputs) of Qwen2-0.5B's linear layers (hidden 896, MLP 4864, 2 KV heads).
SHAPES = [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 2 * 4864, 896), ("down", 896, 4864)]


def _weights(bits: int, n: int, k: int):
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // 32) * 0.01
    zero = torch.full((n, k // 32), float(2 ** (bits - 1)))  # Q8_0 / Q4_0: symmetric, stored + 128 / + 8
    packed = cpu_kernels.pack_w4(q) if bits == 4 else cpu_kernels.pack_w8(q.view(torch.int8)).view(torch.uint8)
    return packed, scale, zero


def _time(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def kernel_parser(description: str) -> argparse.ArgumentParser:
    """The options of the decode-kernel benchmarks (this one, ``int4_group_kernels.py``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rows", type=int, default=1, help="rows of x (decode batch size, at most 16)")
    parser.add_argument("--repeats", type=int, default=15, help="rounds per shape")
    parser.add_argument("--calls", type=int, default=20, help="kernel calls per timing")
    parser.add_argument("--isa", default=None, help="kernel level (default: this process's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return parser


def run_at_isa(args: argparse.Namespace, run) -> None:
    """``run(args)`` with ``--threads`` torch threads, seed 0, at kernel level ``--isa``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with cpu_kernels.using_isa(args.isa) if args.isa else contextlib.nullcontext():
        run(args)


def main() -> None:
    run_at_isa(kernel_parser(__doc__.splitlines()[0]).parse_args(), _run)


def _run(args: argparse.Namespace) -> None:
    print(f"kernels {cpu_kernels.build_info()}, {torch.get_num_threads()} threads, {args.rows} row(s)")
    print(f"{'format':6} {'shape':8} {'N x K':>12} {'float x us':>11} {'int8 x us':>10} {'speed-up':>9}")
    for bits, name in ((8, "Q8_0"), (4, "Q4_0")):
        kernel = cpu_kernels.linear_w4 if bits == 4 else cpu_kernels.linear_w8g
        for shape, n, k in SHAPES:
            packed, scale, zero = _weights(bits, n, k)
            x = torch.randn(args.rows, k).to(torch.bfloat16)
            old = lambda: kernel(x, packed, scale, zero, None, n, False)  # noqa: E731
            new = lambda: kernel(x, packed, scale, zero, None, n, True)  # noqa: E731
            old(), new()
            times_old, times_new = [], []
            for _ in range(args.repeats):
                times_old.append(_time(old, args.calls))
                times_new.append(_time(new, args.calls))
            a, b = statistics.median(times_old), statistics.median(times_new)
            ratio = statistics.median(o / w for o, w in zip(times_old, times_new))
            print(f"{name:6} {shape:8} {n:>5} x {k:<5} {a * 1e6:>10.1f} {b * 1e6:>10.1f} {ratio:>8.2f}x")


if __name__ == "__main__":
    main()
