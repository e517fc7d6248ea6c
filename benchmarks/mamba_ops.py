"""The state ops of one Mamba-2 layer's decode step (``causal_conv1d_update`` of the x / B / C
channels, then ``selective_state_update``), PyTorch's code against the C++ CPU kernels,
alternated in one process (A, B, A, B ..., median), so a loaded machine's noise cancels out.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/mamba_ops.py --batch 1 8 32 --rounds 15

The default shape is Granite-4.0-H-Tiny's Mamba-2 mixer (48 heads of 64, d_state 128, one
group, conv width 4: conv channels 48 * 64 + 2 * 128 = 3328); the state cache holds twice
the batch's slots and each request reads and writes a random one, as in serving. Each round
times ``--calls`` steps of each path on the same inputs (the first path rotating); prints the
median microseconds per step of each path and the kernels' speed-up. On a loaded machine
use ``--threads 1 --cpu-time``: two threads' wall clock then mostly measures the scheduler. The in / out
projections and the gated norm around these ops are left out: they are the same on both paths.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch


def make_step(batch: int, args: argparse.Namespace, kernels: bool) -> Callable[[], None]:
    """One decode step's state ops at ``batch`` requests, on the kernels or PyTorch's code."""
    from pagedllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update, causal_conv1d_update_native
    from pagedllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update, selective_state_update_native

    dtype = getattr(torch, args.dtype)
    heads, head_dim, d_state, groups, width = args.heads, args.head_dim, args.d_state, args.groups, args.width
    conv_dim = heads * head_dim + 2 * groups * d_state
    g = torch.Generator().manual_seed(batch)
    slots = torch.randperm(2 * batch, generator=g)[:batch].to(torch.int32)
    conv_cache = torch.randn(2 * batch, conv_dim, width - 1, generator=g).to(dtype)
    ssm_cache = torch.randn(2 * batch, heads, head_dim, d_state, generator=g) * 0.1
    weight, bias = torch.randn(conv_dim, width, generator=g).to(dtype), torch.randn(conv_dim, generator=g).to(dtype)
    xbc = torch.randn(batch, conv_dim, generator=g).to(dtype)
    dt = torch.randn(batch, heads, generator=g).to(dtype)
    A, D, dt_bias = -torch.rand(heads, generator=g), torch.rand(heads, generator=g), torch.rand(heads, generator=g)
    long_slots = slots.long()
    split = (heads * head_dim, groups * d_state, groups * d_state)

    def step() -> None:
        if kernels:
            conv = causal_conv1d_update(xbc, conv_cache, weight, bias, "silu", slots)
        else:
            conv = causal_conv1d_update_native(xbc, conv_cache, weight, bias, "silu", long_slots)
        x, B, C = torch.split(conv, split, dim=-1)
        x, B, C = x.view(batch, heads, head_dim), B.view(batch, groups, d_state), C.view(batch, groups, d_state)
        if kernels:
            selective_state_update(ssm_cache, x, dt, A, B, C, D, None, dt_bias, True, slots)
        else:
            selective_state_update_native(ssm_cache, x, dt, A, B, C, D, None, dt_bias, True, long_slots)

    return step


def median_us(steps: dict[str, Callable[[], None]], rounds: int, calls: int,
              clock: Callable[[], float]) -> dict[str, float]:
    """Median microseconds per call of each step over ``rounds`` alternated rounds."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for step in steps.values():
        step()  # warm-up
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = clock()
            for _ in range(calls):
                steps[name]()
            times[name].append((clock() - start) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=48)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--d-state", type=int, default=128)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="process CPU time instead of wall clock (for a loaded machine, with --threads 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter

    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.model_executor.layers.mamba.ops import cpu_dispatch

    if not cpu_dispatch.use_kernels():
        raise SystemExit("the C++ CPU kernels do not run the decode ops here (unavailable, or the portable level)")
    print(f"kernels: {cpu_kernels.build_info()}, threads {torch.get_num_threads()}, {args.dtype}")
    print("batch  torch_us  kernel_us  speed-up")
    with torch.inference_mode():
        for batch in args.batch:
            steps = {"torch": make_step(batch, args, False), "kernel": make_step(batch, args, True)}
            us = median_us(steps, args.rounds, args.calls, clock)
            print(f"{batch:5d}  {us['torch']:8.1f}  {us['kernel']:9.1f}  {us['torch'] / us['kernel']:7.2f}x")


if __name__ == "__main__":
    main()
