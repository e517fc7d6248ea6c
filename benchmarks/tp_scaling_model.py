"""A MODEL (a calculation, not a measurement) of tensor-parallel decode scaling on a GPU node.

    python benchmarks/tp_scaling_model.py                                  # 0.5B shape, measure here
    python benchmarks/tp_scaling_model.py --preset llama-8b --batch 1 32 --nvlink-gbps 450
    python benchmarks/tp_scaling_model.py --no-measure --layer-us 20 --head-us 40   # given times

What is measured (on this machine's device, ``--device``; CUDA where present): each rank's
matmuls of one decoder layer (q/k/v, o, gate/up, down) and of the LM head at the sharded
shapes of TP = N (``torch.nn.functional.linear``, median of ``--iters`` runs), so smaller
per-rank GEMMs are not assumed to scale perfectly. Decode attention is added as the time
to read the KV cache (``--context-len`` tokens of this rank's KV heads) at ``--hbm-gbps``.

What is modelled (stated parameters, not measured): the collectives of one decode step —
two all-reduces per layer (after o_proj and down_proj) and one for the vocabulary-parallel
embedding, of ``batch x hidden`` elements, and one all-gather of the logits — each a ring
over N GPUs on NVLink::

    all_reduce(bytes) = latency + 2 (N - 1) / N x bytes / nvlink_bandwidth
    all_gather(total) = latency +     (N - 1) / N x total / nvlink_bandwidth

plus ``--host-overhead-ms`` of per-step host work that does not shrink with N (pagedllm's
Python scheduling and input preparation; measure it as ``pagedllm bench latency``'s decode
step time minus the model's). Step time(N) = layers x (matmuls + attention + 2 all-reduces)
+ LM head + embedding all-reduce + logits all-gather + host overhead.

Defaults: H200-class numbers, NVLink 450 GB/s per direction per GPU, 10 us per collective
(NCCL small-message latency; a custom all-reduce gets 3-5 us), HBM 4,800 GB/s. Sizes whose
heads do not split across N ranks are computed with heads padded up and marked ``*``
(pagedllm refuses them at start-up).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

PRESETS = {
    # hidden, intermediate, layers, heads, kv heads, head dim, vocab
    "qwen2-0.5b-shape": (896, 4864, 24, 14, 2, 64, 32000),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 64, 151936),
    "llama-8b": (4096, 14336, 32, 32, 8, 128, 128256),
}


@dataclass
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def per_rank(self, n: int) -> dict[str, tuple[int, int]]:
        """[out, in] of each rank's matmuls at TP = n (heads padded up where they do not split)."""
        heads = math.ceil(self.heads / n)
        kv = max(1, math.ceil(self.kv_heads / n))
        return {
            "qkv": ((heads + 2 * kv) * self.head_dim, self.hidden),
            "o": (self.hidden, heads * self.head_dim),
            "gate_up": (2 * math.ceil(self.intermediate / n), self.hidden),
            "down": (self.hidden, math.ceil(self.intermediate / n)),
        }

    def splits(self, n: int) -> bool:
        return self.heads % n == 0 and (self.kv_heads % n == 0 or n % self.kv_heads == 0) and self.vocab % n == 0


def time_linear_us(torch, device, dtype, rows: int, out_features: int, in_features: int, iters: int) -> float:
    """Median microseconds of ``linear(x [rows, in], W [out, in])`` on ``device``."""
    x = torch.randn(rows, in_features, device=device, dtype=dtype)
    w = torch.randn(out_features, in_features, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(5):
        torch.nn.functional.linear(x, w)
    samples = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        sync()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2-0.5b-shape", choices=sorted(PRESETS))
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="decode rows per step")
    parser.add_argument("--context-len", type=int, default=1024, help="tokens of KV cache each sequence reads")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 on CUDA, float32 on CPU (whose bf16 matmul may be emulated)")
    parser.add_argument("--device", default=None, help="where to time the matmuls (default: cuda if present, else cpu)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-measure", action="store_true", help="use --layer-us / --head-us instead of timing")
    parser.add_argument("--layer-us", type=float, default=None, help="TP=1 matmul time of one layer (divided by N)")
    parser.add_argument("--head-us", type=float, default=None, help="TP=1 LM head time (divided by N)")
    parser.add_argument("--nvlink-gbps", type=float, default=450.0, help="NVLink GB/s per direction per GPU")
    parser.add_argument("--collective-latency-us", type=float, default=10.0)
    parser.add_argument("--hbm-gbps", type=float, default=4800.0)
    parser.add_argument("--host-overhead-ms", type=float, default=0.0)
    args = parser.parse_args()

    shape = Shape(*PRESETS[args.preset])
    if not args.no_measure:
        import torch

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        dtype = getattr(torch, args.dtype)
        where = f"measured on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} ({args.dtype})"
    elif args.layer_us is None or args.head_us is None:
        parser.error("--no-measure needs --layer-us and --head-us")
    else:
        where = f"given: {args.layer_us} us per layer, {args.head_us} us LM head at TP=1, divided by N"

    args.dtype = args.dtype or "bfloat16"
    elem = 4 if args.dtype == "float32" else 2
    bw = args.nvlink_gbps * 1e3  # bytes per microsecond
    print(f"MODEL of TP decode scaling, {args.preset}: {shape}")
    print(f"Matmuls {where}; collectives MODELLED: ring on NVLink {args.nvlink_gbps:g} GB/s, "
          f"{args.collective_latency_us:g} us each; KV read at {args.hbm_gbps:g} GB/s, context {args.context_len}; "
          f"host overhead {args.host_overhead_ms:g} ms/step")
    print(f"{'batch':>5} {'TP':>3} {'matmul/layer us':>16} {'attn/layer us':>14} {'comm/step us':>13} "
          f"{'step ms':>8} {'speedup':>8} {'efficiency':>10} {'comm share':>10}")
    padded = False
    for batch in args.batch:
        base = None
        for n in args.tp:
            if args.no_measure:
                layer_us, head_us = args.layer_us / n, args.head_us / n
            else:
                layer_us = sum(time_linear_us(torch, device, dtype, batch, o, i, args.iters)
                               for o, i in shape.per_rank(n).values())
                head_us = time_linear_us(torch, device, dtype, batch, math.ceil(shape.vocab / n), shape.hidden, args.iters)
            kv_per_rank = max(1, math.ceil(shape.kv_heads / n))
            attn_us = batch * 2 * args.context_len * kv_per_rank * shape.head_dim * elem / (args.hbm_gbps * 1e3)
            if n == 1:
                comm_us = 0.0
            else:
                ar = args.collective_latency_us + 2 * (n - 1) / n * batch * shape.hidden * elem / bw
                ag = args.collective_latency_us + (n - 1) / n * batch * shape.vocab * elem / bw
                comm_us = (2 * shape.layers + 1) * ar + ag
            step_us = shape.layers * (layer_us + attn_us) + head_us + comm_us + args.host_overhead_ms * 1e3
            base = base or step_us
            mark = "" if shape.splits(n) else "*"
            padded = padded or bool(mark)
            print(f"{batch:>5} {n:>2}{mark:1} {layer_us:>16.1f} {attn_us:>14.1f} {comm_us:>13.1f} "
                  f"{step_us / 1e3:>8.3f} {base / step_us:>7.2f}x {base / step_us / n:>10.0%} {comm_us / step_us:>10.0%}")
    if padded:
        print("* heads do not split across this many ranks: computed with heads padded up (pagedllm refuses it).")


if __name__ == "__main__":
    main()
