"""One ``FusedMoE`` layer of Qwen3-30B-A3B's shape (128 experts of 768, hidden 2048, top-8,
bf16): the fused C++ kernel (``fused_moe``) against the grouped torch path (one matmul pair per
active expert over the stacked weights), alternated call by call in one process.

    PYTHONPATH=. python benchmarks/fused_moe_kernel.py --tokens 1 128 --rounds 30

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--experts", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden, inter, top_k = 2048, 768, 8
    layer = FusedMoE(args.experts, top_k, hidden, inter, params_dtype=torch.bfloat16, prefix="experts")
    with torch.no_grad():
        layer.w13_weight.normal_(0, 0.02)
        layer.w2_weight.normal_(0, 0.02)
    torch_path = layer.quant_method  # before packing: the stacked weights, torch's matmuls
    packed = {name: cpu_kernels.pack_experts(getattr(layer, f"{name}_weight").data) for name in ("w13", "w2")}
    gen = torch.Generator().manual_seed(0)
    print(f"kernels {cpu_kernels.build_info()}, {args.threads} threads, {args.experts} experts")
    with torch.inference_mode():
        for tokens in args.tokens:
            times: dict[str, list[float]] = {"torch": [], "fused": []}
            bytes_read = 0
            for r in range(args.rounds):
                x = torch.randn(tokens, hidden, generator=gen).bfloat16()
                weights, ids = softmax_topk(torch.randn(tokens, args.experts, generator=gen), top_k, True)
                order = ("torch", "fused") if r % 2 == 0 else ("fused", "torch")
                for name in order:
                    start = time.perf_counter()
                    if name == "torch":
                        torch_path.apply(layer, x, weights, ids)
                    else:
                        groups = group_by_expert(weights, ids, args.experts)
                        cpu_kernels.fused_moe(x, groups.token_rows, groups.weights, groups.counts, packed["w13"],
                                              packed["w2"], "silu")
                    times[name].append(time.perf_counter() - start)
                bytes_read += ids.unique().numel() * 3 * hidden * inter * 2
            t_torch, t_fused = (statistics.median(times[n]) * 1e3 for n in ("torch", "fused"))
            rate = bytes_read / sum(times["fused"]) / 1e9
            print(f"tokens {tokens}: torch {t_torch:.2f} ms, fused {t_fused:.2f} ms, fused / torch {t_fused / t_torch:.2f}, "
                  f"fused reads {rate:.1f} GB/s of active experts")


if __name__ == "__main__":
    main()
