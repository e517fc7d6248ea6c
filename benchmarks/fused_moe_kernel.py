"""One ``FusedMoE`` layer of Qwen3-30B-A3B's shape (128 experts of 768, hidden 2048, top-8,
bf16): the fused C++ kernel (``fused_moe``) against the grouped torch path (one matmul pair per
active expert over the stacked weights), alternated call by call in one process.

    PYTHONPATH=. python benchmarks/fused_moe_kernel.py --tokens 1 128 --rounds 30 [--int8]

``--int8`` adds a third path, ``fused_moe_w8`` on the same experts quantized per output channel
(``--quantization int8``'s experts: half the bytes of bf16), in the same alternation.

Prints, per token count, the median ms per call of each path, their ratio, and the fused
kernel's read rate (active experts' weight bytes / time). Random routing each round (the same
for both paths), so each call reads fresh experts rather than the caches' copies.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.fused_moe.expert_groups import group_by_expert
from pagedllm.model_executor.layers.fused_moe.router import softmax_topk
from pagedllm.model_executor.layers.quantization.int8 import quantize_int8_per_channel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--int8", action="store_true", help="also time fused_moe_w8 on int8 experts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden, inter, top_k = 2048, 768, 8
    layer = FusedMoE(args.experts, top_k, hidden, inter, params_dtype=torch.bfloat16, prefix="experts")
    with torch.no_grad():
        layer.w13_weight.normal_(0, 0.02)
        layer.w2_weight.normal_(0, 0.02)
    torch_path = layer.quant_method  # before packing: the stacked weights, torch's matmuls
    packed = {name: cpu_kernels.pack_experts(getattr(layer, f"{name}_weight").data) for name in ("w13", "w2")}
    if args.int8:
        for name in ("w13", "w2"):
            q, scale = zip(*(quantize_int8_per_channel(w) for w in getattr(layer, f"{name}_weight").data))
            packed[f"{name}_q"], packed[f"{name}_scale"] = cpu_kernels.pack_experts(torch.stack(q)), torch.stack(scale)
    paths = ("torch", "fused", "int8") if args.int8 else ("torch", "fused")
    gen = torch.Generator().manual_seed(0)
    print(f"kernels {cpu_kernels.build_info()}, {args.threads} threads, {args.experts} experts")
    with torch.inference_mode():
        for tokens in args.tokens:
            times: dict[str, list[float]] = {name: [] for name in paths}
            bytes_read = 0
            for r in range(args.rounds):
                x = torch.randn(tokens, hidden, generator=gen).bfloat16()
                weights, ids = softmax_topk(torch.randn(tokens, args.experts, generator=gen), top_k, True)
                order = paths if r % 2 == 0 else paths[::-1]
                for name in order:
                    start = time.perf_counter()
                    if name == "torch":
                        torch_path.apply(layer, x, weights, ids)
                    elif name == "fused":
                        groups = group_by_expert(weights, ids, args.experts)
                        cpu_kernels.fused_moe(x, groups.token_rows, groups.weights, groups.counts, packed["w13"],
                                              packed["w2"], "silu")
                    else:
                        groups = group_by_expert(weights, ids, args.experts)
                        cpu_kernels.fused_moe_w8(x, groups.token_rows, groups.weights, groups.counts, packed["w13_q"],
                                                 packed["w2_q"], packed["w13_scale"], packed["w2_scale"], "silu")
                    times[name].append(time.perf_counter() - start)
                bytes_read += ids.unique().numel() * 3 * hidden * inter * 2
            t_torch, t_fused = (statistics.median(times[n]) * 1e3 for n in ("torch", "fused"))
            rate = bytes_read / sum(times["fused"]) / 1e9
            print(f"tokens {tokens}: torch {t_torch:.2f} ms, fused {t_fused:.2f} ms, fused / torch {t_fused / t_torch:.2f}, "
                  f"fused reads {rate:.1f} GB/s of active experts")
            if args.int8:
                t_int8 = statistics.median(times["int8"]) * 1e3
                print(f"tokens {tokens}: fused int8 {t_int8:.2f} ms, fused / fused int8 {t_fused / t_int8:.2f}, "
                      f"int8 reads {bytes_read / 2 / sum(times['int8']) / 1e9:.1f} GB/s of active experts")


if __name__ == "__main__":
    main()
