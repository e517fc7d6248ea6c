"""``pagedllm bench latency``: one batch of fixed size, timed step by step.

Each iteration adds ``--batch-size`` random prompts of ``--input-len`` tokens (fresh ones
every iteration, prefix cache reset, so nothing is reused) to the ``LLMEngine`` and calls
``step()`` until all finish, timing every step. The prefill time is the time from the
first ``add_request`` until every request has its first token (several steps when the
prompts exceed ``max_num_batched_tokens``); every later step is a decode step producing
one token per request, and its duration is the per-token decode latency. The batch-1
number (``--batch-size 1``) is the one compared with llama.cpp's ``tg`` rate.

Reported (also in ``--output-json``): vLLM's ``avg_latency``/``latencies``/``percentiles``
(end-to-end seconds per batch), ``prefill_time_s``, ``decode_token_latency_ms`` (mean,
p50, p99), ``decode_tokens_per_s`` (batch / mean decode step) and ``output_tokens_per_s``
(batch x output length / end-to-end latency).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from pagedllm.benchmarks import comm_stats, machine_info, set_num_threads, summarize, write_json
from pagedllm.benchmarks.datasets import random_dataset, repeat_dataset
from pagedllm.benchmarks.throughput import add_model_args, build_llm, engine_kwargs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dataset-name", default="random", choices=["random", "repeat"],
                        help="random token ids (default), or 'repeat': text passages the model is cued to "
                        "repeat (an input-grounded task for n-gram speculation; see benchmarks.datasets)")
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--output-json", default=None)


def run_iteration(engine: Any, tokenizer: Any, args: argparse.Namespace, seed: int, tag: str) -> dict[str, Any]:
    """One batch through the engine; per-step timings."""
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    dataset = repeat_dataset if args.dataset_name == "repeat" else random_dataset
    requests = dataset(tokenizer, args.batch_size, args.input_len, args.output_len, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    try:
        engine.reset_prefix_cache()
    except (AttributeError, RuntimeError):
        pass
    start = time.perf_counter()
    ids = []
    for j, r in enumerate(requests):
        rid = f"{tag}-{j}"
        engine.add_request(rid, {"prompt_token_ids": r.prompt_token_ids}, params)
        ids.append(rid)
    started: set[str] = set()
    prefill_end = None
    decode_steps: list[float] = []
    decode_request_steps = 0  # (request, decode step) pairs that produced tokens
    num_prefill_steps = 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        if prefill_end is None:
            num_prefill_steps += 1
            for out in outputs:
                if out.outputs and len(out.outputs[0].token_ids) > 0:
                    started.add(out.request_id)
            if len(started) == len(ids):
                prefill_end = t1
        else:
            decode_steps.append(t1 - t0)
            decode_request_steps += sum(1 for out in outputs if out.outputs and out.outputs[0].token_ids)
    end = time.perf_counter()
    return {
        "latency": end - start,
        "prefill_time": (prefill_end or end) - start,
        "num_prefill_steps": num_prefill_steps,
        "decode_steps": decode_steps,
        "decode_request_steps": decode_request_steps,
    }


def decode_tokens_per_s(args: argparse.Namespace, iters: list[dict[str, Any]]) -> float:
    """Tokens generated after each request's first, per second of decode steps (so speculative
    decoding's several tokens per step count)."""
    decode_time = sum(sum(it["decode_steps"]) for it in iters)
    return args.batch_size * (args.output_len - 1) * len(iters) / decode_time if decode_time else 0.0


def tokens_per_request_step(args: argparse.Namespace, iters: list[dict[str, Any]]) -> float:
    """Decode tokens per request per step: 1.0 without speculative decoding, else the mean
    acceptance length (accepted drafts + 1) over the decode steps, as vLLM defines it."""
    request_steps = sum(it["decode_request_steps"] for it in iters)
    return args.batch_size * (args.output_len - 1) * len(iters) / request_steps if request_steps else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    set_num_threads(args.num_threads)
    llm, init_time = build_llm(args)
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    for i in range(args.num_iters_warmup):
        run_iteration(engine, tokenizer, args, seed=100_000 + i, tag=f"warmup{i}")
    comm_stats.reset(llm)
    iters = [run_iteration(engine, tokenizer, args, seed=args.seed + i, tag=f"iter{i}")
             for i in range(args.num_iters)]
    latencies = [it["latency"] for it in iters]
    prefill = [it["prefill_time"] for it in iters]
    decode_ms = [1000.0 * d for it in iters for d in it["decode_steps"]]
    decode = summarize(decode_ms, (50, 99))
    avg_latency = float(np.mean(latencies))
    result: dict[str, Any] = {
        "benchmark": "latency",
        "backend": "pagedllm",
        "model": args.model,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dataset_name": args.dataset_name,
        "num_iters": args.num_iters,
        "init_time_s": init_time,
        "avg_latency": avg_latency,
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in (10, 25, 50, 75, 90, 99)},
        "prefill_time_s": float(np.mean(prefill)),
        "prefill_times_s": prefill,
        "prefill_tokens_per_s": args.batch_size * args.input_len / float(np.mean(prefill)),
        "num_prefill_steps": iters[0]["num_prefill_steps"] if iters else 0,
        "num_decode_steps": len(decode_ms),
        # Per step; with speculative decoding a step yields several tokens per request.
        "decode_token_latency_ms": {"mean": decode["mean"], "p50": decode["p50"], "p99": decode["p99"]},
        "decode_tokens_per_s": decode_tokens_per_s(args, iters),
        "tokens_per_request_step": tokens_per_request_step(args, iters),
        "output_tokens_per_s": args.batch_size * args.output_len / avg_latency,
        "engine_args": {k: v for k, v in engine_kwargs(args).items() if k not in ("model", "tokenizer")},
        "machine": machine_info(),
    }
    tp_stats = comm_stats.collect(llm, sum(latencies))
    if tp_stats is not None:
        result["tensor_parallel_comm"] = tp_stats
    return result


def print_result(r: dict[str, Any]) -> None:
    d = r["decode_token_latency_ms"]
    m = r["machine"]
    print(f"CPU ISA {m['cpu_isa']}" + (f" (run at {m['cpu_isa_override']})" if m["cpu_isa_override"] else ""))
    print(f"Batch {r['batch_size']} x ({r['input_len']} in, {r['output_len']} out; {r['dataset_name']} dataset), "
          f"{r['num_iters']} iterations")
    print(f"Avg latency: {r['avg_latency']:.4f} s (start-up {r['init_time_s']:.2f} s)")
    print(f"Prefill: {r['prefill_time_s'] * 1000:.1f} ms ({r['prefill_tokens_per_s']:.1f} tokens/s, "
          f"{r['num_prefill_steps']} steps)")
    print(f"Decode step latency: mean {d['mean']:.2f} ms, p50 {d['p50']:.2f} ms, p99 {d['p99']:.2f} ms "
          f"-> {r['decode_tokens_per_s']:.1f} tokens/s ({r['tokens_per_request_step']:.2f} tokens per request per step)")
    print(f"Output tokens/s (end to end): {r['output_tokens_per_s']:.1f}")
    comm_stats.print_stats(r.get("tensor_parallel_comm"))


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print_result(result)
    write_json(args.output_json, result)
    return 0
