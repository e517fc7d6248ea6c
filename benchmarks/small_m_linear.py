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

``--steps``: end to end instead, one engine per ``--model`` (batch 1, greedy, bf16; with
``--speculative-config``, e.g. n-gram on the ``repeat`` prompts) running the same prompts
with ``linear()``'s few-row kernel set to vdpbf16ps and to AMX tiles in turn, round after
round; prints each path's median step time by tokens in the step (1: a plain decode step;
1 + k: a verifying step) and the verifying step's cost in 1-token steps:

    python benchmarks/small_m_linear.py --steps --cpu-time --rounds 30 --output-len 64 \
        --model pagedllm/assets/pagedllm-default --speculative-config \
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'

Needs the CPU kernels at the avx512_bf16 level (``PAGEDLLM_CPU_ISA`` unset or avx512_bf16) and a
CPU with AVX512-BF16; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


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


def set_amx(amx: bool) -> None:
    """Have ``linear()`` use AMX tiles (where it may) or vdpbf16ps for every checked shape."""
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.model_executor.layers import cpu_gemm

    for shape, (block_n, _) in cpu_gemm._packed_linear_shapes.items():
        cpu_gemm._packed_linear_shapes[shape] = (block_n, amx and block_n == 32 and cpu_kernels.has_amx())


def step_times(args: argparse.Namespace, model: str, clock: Any) -> None:
    """The ``--steps`` mode for one model (see the module docstring)."""
    from pagedllm.benchmarks import latency
    from pagedllm.entrypoints.llm import LLM

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    llm = LLM(model=model, dtype="bfloat16", speculative_config=spec, max_model_len=args.input_len + args.output_len + 16,
              kv_cache_memory_bytes=64 << 20)
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    scheduler = engine.engine_core.scheduler
    schedule, tokens = scheduler.schedule, [0]

    def counting_schedule(*a: Any, **k: Any) -> Any:
        out = schedule(*a, **k)
        tokens[0] = out.total_num_scheduled_tokens
        return out

    scheduler.schedule = counting_schedule
    times: dict[str, dict[int, list[float]]] = {p: collections.defaultdict(list) for p in ("vdpbf16ps", "amx")}

    class Timed:
        def __init__(self, path: str) -> None:
            self.path = path

        def step(self) -> Any:
            start = clock()
            out = engine.step()
            times[self.path][tokens[0]].append((clock() - start) * 1e3)
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

    run_args = argparse.Namespace(dataset_name=args.dataset_name, batch_size=1, input_len=args.input_len,
                                  output_len=args.output_len)
    latency.run_iteration(engine, tokenizer, run_args, seed=10_000, tag="warm")
    for r in range(args.rounds):
        for path in ("vdpbf16ps", "amx") if r % 2 == 0 else ("amx", "vdpbf16ps"):
            set_amx(path == "amx")
            latency.run_iteration(Timed(path), tokenizer, run_args, seed=r // 2, tag=f"{path}-{r}")
    set_amx(True)
    for n in sorted(set(times["amx"]) & set(times["vdpbf16ps"])):
        if n > 16:  # prefill
            continue
        med = {p: statistics.median(t[n]) for p, t in times.items()}
        print(f"{Path(model).name}: {n}-token steps: vdpbf16ps {med['vdpbf16ps']:.3f} ms (n={len(times['vdpbf16ps'][n])}), "
              f"amx {med['amx']:.3f} ms (n={len(times['amx'][n])}), amx / vdpbf16ps {med['amx'] / med['vdpbf16ps']:.3f}")
    k = max((n for n in times["amx"] if n <= 16), default=1)
    for path, t in times.items():
        if t[1] and t[k] and k > 1:
            print(f"{Path(model).name}: {path}: a {k}-token step costs {statistics.median(t[k]) / statistics.median(t[1]):.2f} 1-token steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["pagedllm/assets/pagedllm-default"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="calls per timing sample")
    parser.add_argument("--layers", nargs="+", help="only these layers (qkv o gate_up down lm_head)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one torch thread, timed by the process's CPU time (a busy machine does not stretch it)")
    parser.add_argument("--steps", action="store_true", help="engine steps end to end, vdpbf16ps vs AMX tiles")
    parser.add_argument("--speculative-config", help="--steps: the engine's speculative_config (JSON)")
    parser.add_argument("--dataset-name", default="repeat", choices=["repeat", "random"], help="--steps: prompts")
    parser.add_argument("--input-len", type=int, default=256, help="--steps: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="--steps: tokens generated per prompt")
    args = parser.parse_args()

    import torch

    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.model_executor.layers import cpu_gemm

    if not cpu_kernels.has_packed_linear():
        sys.exit("packed_linear is not available here (needs the avx512_bf16 kernel level and CPU)")
    if args.cpu_time:
        torch.set_num_threads(1)
    clock = time.process_time if args.cpu_time else time.perf_counter

    print(f"torch threads {torch.get_num_threads()}, kernels {cpu_kernels.build_info()}")
    if args.steps:
        if not cpu_kernels.has_amx():
            sys.exit("--steps compares vdpbf16ps with AMX tiles: this CPU / OS has no AMX tiles")
        for model in args.model:
            step_times(args, model, clock)
        return
    header = f"{'model':<22} {'layer':<8} {'[out, in]':<12} {'rows':>4}"
    for model in map(Path, args.model):
        shapes = layer_shapes(model)
        for name, (n, k) in shapes.items():
            if args.layers and name not in args.layers:
                continue
            torch.manual_seed(n + k)
            weight = cpu_gemm.pack_weight(torch.randn(n, k).to(torch.bfloat16))
            if (n, k) not in cpu_gemm._packed_linear_shapes:
                print(f"{model.name} {name} {n}x{k}: packed_linear does not read this layout; skipped")
                continue
            block_n, amx = cpu_gemm._packed_linear_shapes[(n, k)]
            variants = {"vdpbf16ps": lambda x: cpu_kernels.packed_linear(x, weight, None, block_n)}
            if amx:
                variants["amx"] = lambda x: cpu_kernels.packed_linear(x, weight, None, block_n, True)
            variants["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
            variants["linear"] = lambda x: cpu_gemm.linear(x, weight)
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
