"""The gated delta rule of one Gated DeltaNet layer: its decode step
(``fused_recurrent_gated_delta_rule``) and a prefill chunk (``chunk_gated_delta_rule``),
PyTorch's code against the C++ CPU kernels (``gated_delta.cpp``), alternated in one process
(A, B, A, B ..., median), so a loaded machine's noise cancels out.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gated_delta_ops.py --batch 1 8 32 --prefill 512

The default shape is Qwen3-Next-80B-A3B's linear attention (16 key heads and 32 value heads of
128, q/k L2-normed); the state cache holds twice the batch's slots and each request reads and
writes a random one, as in serving. ``--prefill N``: one request's chunk of N tokens from its
state (PyTorch's chunked form against the kernel's token-by-token recurrence). Prints the
median microseconds per call of each path and the kernels' speed-up. On a loaded machine use
``--threads 1 --cpu-time``. The projections, the conv and the gated norm around the rule are
left out: they are the same on both paths.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

# The sibling script (this folder is sys.path[0] when run as ``python benchmarks/...``).
from mamba_ops import median_us  # noqa: E402  isort: skip


def make_inputs(tokens: int, slots: int, args: argparse.Namespace, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k [tokens, H, K], v [tokens, HV, V] (``--dtype``), g, beta [tokens, HV] float32 and a
    float32 state cache of ``slots`` slots."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, args.dtype)
    q, k = (torch.randn(tokens, args.k_heads, args.head_dim, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(tokens, args.v_heads, args.head_dim, generator=g).to(dtype)
    decay = -torch.rand(tokens, args.v_heads, generator=g) * 0.5
    beta = torch.rand(tokens, args.v_heads, generator=g)
    state = torch.randn(slots, args.v_heads, args.head_dim, args.head_dim, generator=g) * 0.1
    return q, k, v, decay, beta, state


def make_decode(batch: int, args: argparse.Namespace, kernels: bool) -> Callable[[], None]:
    """One decode step at ``batch`` requests, on the kernel or PyTorch's code."""
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.model_executor.layers.mamba.ops.gated_delta import fused_recurrent_gated_delta_rule_native

    q, k, v, decay, beta, state = make_inputs(batch, 2 * batch, args, batch)
    slots = torch.randperm(2 * batch, generator=torch.Generator().manual_seed(batch))[:batch].to(torch.int32)
    long_slots, scale = slots.long(), args.head_dim ** -0.5

    def step() -> None:
        if kernels:
            cpu_kernels.gated_delta_rule_decode(q, k, v, decay, beta, state, slots, scale, True)
        else:
            fused_recurrent_gated_delta_rule_native(q, k, v, decay, beta, state, long_slots, None, True)

    return step


def make_prefill(tokens: int, args: argparse.Namespace, kernels: bool) -> Callable[[], None]:
    """One request's prefill chunk of ``tokens`` tokens from its state."""
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.model_executor.layers.mamba.ops.gated_delta import chunk_gated_delta_rule_native

    q, k, v, decay, beta, state = make_inputs(tokens, 1, args, tokens)
    bounds, slots, initial = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([0]), torch.tensor([True])

    def step() -> None:
        if kernels:
            cpu_kernels.gated_delta_rule_prefill(q, k, v, decay, beta, state, bounds, slots, initial,
                                                 args.head_dim ** -0.5, True)
        else:
            chunk_gated_delta_rule_native(q, k, v, decay, beta, state, [0, tokens], [0], [True], None, True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefill", type=int, nargs="*", default=[], help="prefill chunk lengths to time")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--k-heads", type=int, default=16)
    parser.add_argument("--v-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
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
        raise SystemExit("the C++ CPU kernels do not run the state ops here (unavailable, or the portable level)")
    print(f"kernels: {cpu_kernels.build_info()}, threads {torch.get_num_threads()}, {args.dtype}")
    print("op       size  torch_us  kernel_us  speed-up")
    with torch.inference_mode():
        cases = [("decode", n, make_decode) for n in args.batch] + [("prefill", n, make_prefill) for n in args.prefill]
        for op, n, make in cases:
            us = median_us({"torch": make(n, args, False), "kernel": make(n, args, True)}, args.rounds, args.calls,
                           clock)
            print(f"{op:7s} {n:5d}  {us['torch']:8.1f}  {us['kernel']:9.1f}  {us['torch'] / us['kernel']:7.2f}x")


if __name__ == "__main__":
    main()
