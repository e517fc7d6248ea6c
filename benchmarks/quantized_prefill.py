"""Many-row matmul on quantized weights against the bf16 layer, interleaved in one process.

For each layer shape of the 0.5B model (qkv, o, gate_up, down) and each row count, times
the bf16 layer's matmul (oneDNN on the packed weight, ``linear.linear``) and, on the same
random weights quantized, ``linear_dequant`` (int8 per channel, int4 in groups of 128 with
zero points, FP8; int8 with per-token int8 activations through oneDNN's int8 GEMM, where
exact) and, up to their 16 rows, the few-row kernels (``linear_w8`` / ``linear_w4`` / ``linear_fp8``),
alternating A, B, C... ``--repeats`` times, and prints the median of each and its ratio to
bf16 (> 1: slower). Interleaving cancels the load of a shared machine; on a very busy one,
``--cpu-time`` runs one thread and times its CPU time (``time.thread_time``), which other
processes do not stretch. ``--tile-cols``
overrides ``linear_dequant``'s tile width (0: its own choice).

    python benchmarks/quantized_prefill.py --rows 128 512 2048 --repeats 7
    python benchmarks/quantized_prefill.py --rows 4 8 16 32 --repeats 15   # the threshold
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers import cpu_gemm
from pagedllm.model_executor.layers.quantization.fp8 import quantize_fp8_per_tensor
from pagedllm.model_executor.layers.quantization.int8 import onednn_int8_gemm_exact, quantize_int8_per_channel

#: (name, outputs, inputs) of the 0.5B shape's linear layers (Qwen2-0.5B: hidden 896,
#: intermediate 4864, 14 query and 2 key/value heads of 64).
SHAPES = [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864)]


def _int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization in groups (min / max per group): Q uint8, scale, zero."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    zero = torch.round(-lo / scale)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return q, scale.contiguous(), zero.contiguous()


def _variants(n: int, k: int, tile_cols: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
    packed = cpu_gemm.pack_weight(w) if cpu_gemm.can_pack(w) else w
    q8, s8 = quantize_int8_per_channel(w)
    p8 = cpu_kernels.pack_w8(q8)
    q4, s4, z4 = _int4_groups(w, 128)
    p4 = cpu_kernels.pack_w4(q4)
    f8, sf = quantize_fp8_per_tensor(w)
    pf = cpu_kernels.pack_w8(f8.view(torch.int8)).view(torch.float8_e4m3fn)
    sf = sf.expand(n).contiguous()
    variants = {
        "bf16": lambda x: cpu_gemm.linear(x, packed),
        "int8 dequant": lambda x: cpu_kernels.linear_dequant(x, p8, s8, None, None, n, 8, tile_cols),
        "int8 few-row": lambda x: cpu_kernels.linear_w8(x, p8, s8, None, n),
        "int4 dequant": lambda x: cpu_kernels.linear_dequant(x, p4, s4, z4, None, n, 4, tile_cols),
        "int4 few-row": lambda x: cpu_kernels.linear_w4(x, p4, s4, z4, None, n),
        "fp8 dequant": lambda x: cpu_kernels.linear_dequant(x, pf, sf, None, None, n, 8, tile_cols),
    }
    if onednn_int8_gemm_exact():
        pi = torch.ops.onednn.qlinear_prepack(q8, None)
        variants["int8 int8-act"] = lambda x: cpu_kernels.linear_dequant(x, pi, s8, None, None, n, 8)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tile-cols", type=int, default=0)
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time")
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    parser.add_argument("--skip", nargs="*", default=[], help="variants to leave out, e.g. 'int8 few-row'")
    args = parser.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(f"CPU kernels: {cpu_kernels.build_info()}, {torch.get_num_threads()} threads")
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        variants = {v: f for v, f in _variants(n, k, args.tile_cols).items() if v not in args.skip}
        for m in args.rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            # The few-row kernels take at most FEW_ROWS_MAX rows.
            in_range = {v: f for v, f in variants.items() if m <= cpu_kernels.FEW_ROWS_MAX or "few-row" not in v}
            times: dict[str, list[float]] = {v: [] for v in in_range}
            for f in in_range.values():
                f(x)  # warm-up (oneDNN primitive creation)
            for _ in range(args.repeats):
                for v, f in in_range.items():
                    start = clock()
                    f(x)
                    times[v].append(clock() - start)
            base = statistics.median(times["bf16"])
            cells = [f"{v} {statistics.median(t) * 1e3:.2f} ms ({statistics.median(t) / base:.2f}x)" for v, t in times.items()]
            print(f"{name:8s} [{n}x{k}] M={m:5d}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
