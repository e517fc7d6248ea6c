"""Speculative decoding's speed-up, with and without, interleaved in one process (issue 16).

    python benchmarks/spec_decode_bench.py --model benchmarks/checkpoints/qwen2-0.5b-shape \\
        --batch-sizes 1 8 --input-len 128 --output-len 128 --rounds 3 \\
        --speculative-config '{"model": "benchmarks/checkpoints/qwen2-draft-shape", "num_speculative_tokens": 4}'
    python benchmarks/spec_decode_bench.py --dataset-name repeat --batch-sizes 1 8 --input-len 256 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'

Builds two engines on the same model, one plain and one with ``--speculative-config``, warms
both, then runs ``pagedllm bench latency``'s iteration (``--batch-size`` fresh prompts,
greedy, EOS ignored, timed step by step) on each in turn, round after round with the same
prompts for both engines in a round and the order flipped every round, so machine load
that drifts during the run falls on both alike. Per batch size it prints each round's
decode tokens/s (tokens after each request's first, per second of decode steps), the
median of the per-round ratios spec / plain, the pooled ratio (all rounds' plain decode
time over all rounds' spec decode time: the same tokens), and the mean acceptance length
(decode tokens per request per step: 1 + accepted drafts; vLLM's "Mean acceptance length").
Where acceptance varies from prompt to prompt (n-gram lookup), the median round is the
prompt of median acceptance, below the mean acceptance printed; the pooled ratio weighs
every prompt by its decode time.
``--output-json`` keeps every round. On a loaded machine, ``--cpu-time`` (with
``--num-threads 1``) times the decode steps by the process's CPU time instead of the wall
clock, so other jobs' bursts do not land on one side of a round.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

try:
    from pagedllm.benchmarks import latency
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pagedllm.benchmarks import latency

from pagedllm.benchmarks import machine_info, set_num_threads, write_json
from pagedllm.benchmarks.throughput import build_llm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    latency.add_cli_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8],
                        help="batch sizes measured, each with the same two engines (overrides --batch-size)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated (plain, spec) pairs per batch size")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time decode steps by process CPU time (a loaded machine; use --num-threads 1)")
    args = parser.parse_args(argv)
    if args.speculative_config is None:
        parser.error("--speculative-config is required (the engine measured against the plain one)")
    return args


class _CpuTimedSteps:
    """``engine`` with each ``step()`` timed by process CPU time (seconds, in ``steps``)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.steps: list[float] = []

    def step(self) -> Any:
        start = time.process_time()
        out = self._engine.step()
        self.steps.append(time.process_time() - start)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def measure(engine: Any, tokenizer: Any, args: argparse.Namespace, seed: int, tag: str) -> dict[str, float]:
    """One latency iteration; its decode tokens/s (per CPU second with ``--cpu-time``) and
    tokens per request per decode step."""
    timed = _CpuTimedSteps(engine) if args.cpu_time else None
    it = latency.run_iteration(timed or engine, tokenizer, args, seed=seed, tag=tag)
    if timed is not None:
        it["decode_steps"] = timed.steps[it["num_prefill_steps"]:]
    return {"decode_tokens_per_s": latency.decode_tokens_per_s(args, [it]),
            "tokens_per_request_step": latency.tokens_per_request_step(args, [it]),
            "latency_s": it["latency"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    set_num_threads(args.num_threads)
    plain_args = copy.copy(args)
    plain_args.speculative_config = None
    engines = {}
    for name, engine_args in (("plain", plain_args), ("spec", args)):
        llm, init_time = build_llm(engine_args)
        engines[name] = (llm.llm_engine, llm.get_tokenizer())
        print(f"{name}: engine built in {init_time:.1f} s", flush=True)
    result: dict[str, Any] = {"speculative_config": args.speculative_config, "model": args.model,
                              "dataset_name": args.dataset_name, "input_len": args.input_len,
                              "output_len": args.output_len, "cpu_time": args.cpu_time, "batch_sizes": {},
                              "machine": machine_info()}
    for batch_size in args.batch_sizes:
        run_args = copy.copy(args)
        run_args.batch_size = batch_size
        for name, (engine, tokenizer) in engines.items():
            for i in range(args.num_iters_warmup):
                latency.run_iteration(engine, tokenizer, run_args, seed=100_000 + i, tag=f"warm-{name}-{batch_size}-{i}")
        rounds = []
        unit = "tok per CPU-s" if args.cpu_time else "tok/s"
        for r in range(args.rounds):
            order = ("plain", "spec") if r % 2 == 0 else ("spec", "plain")
            row = {name: measure(*engines[name], run_args, seed=args.seed + r, tag=f"{name}-{batch_size}-{r}")
                   for name in order}
            row["ratio"] = row["spec"]["decode_tokens_per_s"] / row["plain"]["decode_tokens_per_s"]
            rounds.append(row)
            print(f"batch {batch_size} round {r}: plain {row['plain']['decode_tokens_per_s']:.1f} {unit}, "
                  f"spec {row['spec']['decode_tokens_per_s']:.1f} {unit} ({row['ratio']:.2f}x), "
                  f"mean acceptance length {row['spec']['tokens_per_request_step']:.2f}", flush=True)
        summary = {
            "median_ratio": float(np.median([row["ratio"] for row in rounds])),
            "plain_decode_tokens_per_s": float(np.median([row["plain"]["decode_tokens_per_s"] for row in rounds])),
            "spec_decode_tokens_per_s": float(np.median([row["spec"]["decode_tokens_per_s"] for row in rounds])),
            "pooled_ratio": (sum(1.0 / row["plain"]["decode_tokens_per_s"] for row in rounds)
                             / sum(1.0 / row["spec"]["decode_tokens_per_s"] for row in rounds)),
            "mean_acceptance_length": float(np.mean([row["spec"]["tokens_per_request_step"] for row in rounds])),
            "rounds": rounds,
        }
        result["batch_sizes"][batch_size] = summary
        print(f"batch {batch_size}: median speed-up {summary['median_ratio']:.2f}x "
              f"({summary['plain_decode_tokens_per_s']:.1f} -> {summary['spec_decode_tokens_per_s']:.1f} decode {unit}), "
              f"pooled {summary['pooled_ratio']:.2f}x, "
              f"mean acceptance length {summary['mean_acceptance_length']:.2f} "
              f"(k = {args.speculative_config.get('num_speculative_tokens')})", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps({b: s["median_ratio"] for b, s in result["batch_sizes"].items()}))
    write_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
