"""Few-row bf16 matmuls on oneDNN-packed weights, per layer shape and row count: each
kernel ``linear()`` can send them to, alternated in one process (A, B, A, B ..., median), so
a loaded machine's noise cancels out. The per-shape table behind ``SMALL_M_ROWS`` and the
few-row kernel choice in ``pagedllm/model_executor/layers/linear.py`` (speculative decoding's
verifying steps are 1 + k rows at batch 1).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/small_m_linear.py \\
        --model pagedllm/assets/pagedllm-default benchmarks/checkpoints/qwen2-0.5b-shape \\
        --rows 1 2 3 5 8 16 --rounds 15

Per model (its config.json: hidden, intermediate, heads, vocabulary), the layer shapes
[out, in] of one decoder layer and the lm_head: qkv, o, gate_up, down, lm_head. Each round
times ``--calls`` calls of every variant on the same bf16 input, in turn (the first variant
rotating); prints the median microseconds per call of each variant and its time relative to
the first (< 1: faster):

- ``vdpbf16ps``: the weight-streaming kernel (``packed_linear.cpp``) with AVX512-BF16 dot products;
- ``amx``: the same kernel with AMX tiles (where ``linear.py`` uses them: 32-output blocks
  and ``has_amx()``; else left out);
- ``onednn``: oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``; AMX where the CPU has it);
- ``linear``: what ``linear()`` chooses here.

Under load (other processes on the cores), use ``--cpu-time``: two threads' wall clock then
mostly measures the scheduler (a call waits for a descheduled thread).

Needs the CPU kernels at the avx512_bf16 level (``PAGEDLLM_CPU_ISA`` unset or avx512_bf16) and a
CPU with AVX512-BF16; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def layer_shapes(model: Path) -> dict[str, tuple[int, int]]:
    """{layer: (out, in)} of one decoder layer and the lm_head, from ``model``/config.json."""
    config = json.loads((model / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (config["vocab_size"], hidden),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["pagedllm/assets/pagedllm-default"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="calls per timing sample")
    parser.add_argument("--layers", nargs="+", help="only these layers (qkv o gate_up down lm_head)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one torch thread, timed by the process's CPU time (a busy machine does not stretch it)")
    args = parser.parse_args()

    import torch

    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.model_executor.layers import linear as linear_mod

    if not cpu_kernels.has_packed_linear():
        sys.exit("packed_linear is not available here (needs the avx512_bf16 kernel level and CPU)")
    if args.cpu_time:
        torch.set_num_threads(1)
    clock = time.process_time if args.cpu_time else time.perf_counter

    print(f"torch threads {torch.get_num_threads()}, kernels {cpu_kernels.build_info()}")
    header = f"{'model':<22} {'layer':<8} {'[out, in]':<12} {'rows':>4}"
    for model in map(Path, args.model):
        shapes = layer_shapes(model)
        for name, (n, k) in shapes.items():
            if args.layers and name not in args.layers:
                continue
            torch.manual_seed(n + k)
            weight = linear_mod.pack_weight(torch.randn(n, k).to(torch.bfloat16))
            if (n, k) not in linear_mod._packed_linear_shapes:
                print(f"{model.name} {name} {n}x{k}: packed_linear does not read this layout; skipped")
                continue
            block_n, amx = linear_mod._packed_linear_shapes[(n, k)]
            variants = {"vdpbf16ps": lambda x: cpu_kernels.packed_linear(x, weight, None, block_n)}
            if amx:
                variants["amx"] = lambda x: cpu_kernels.packed_linear(x, weight, None, block_n, True)
            variants["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
            variants["linear"] = lambda x: linear_mod.linear(x, weight)
            if name == "qkv" and model == Path(args.model[0]):
                print(header + "".join(f" {v + ' us':>17}" for v in variants) + "  (relative to the first)")
            for rows in args.rows:
                x = torch.randn(rows, k).to(torch.bfloat16)
                samples: dict[str, list[float]] = {v: [] for v in variants}
                names = list(variants)
                for fn in variants.values():  # warm-up
                    fn(x)
                with torch.inference_mode():
                    for r in range(args.rounds):
                        for v in names[r % len(names):] + names[: r % len(names)]:
                            fn = variants[v]
                            start = clock()
                            for _ in range(args.calls):
                                fn(x)
                            samples[v].append((clock() - start) / args.calls * 1e6)
                medians = {v: statistics.median(s) for v, s in samples.items()}
                base = medians[names[0]]
                cells = "".join(f" {medians[v]:8.1f} ({medians[v] / base:4.2f})" for v in names)
                print(f"{model.name:<22} {name:<8} {f'{n}x{k}':<12} {rows:>4}{cells}", flush=True)


if __name__ == "__main__":
    main()
