"""``pagedllm bench prefix-caching``: what automatic prefix caching buys, and what it costs.

Two measurements, each with caching off and on in the same run (same prompts, engines
built side by side and alternated, so machine noise hits both):

* ``--mode ttft`` (default): requests from ``--dataset-name prefix_repetition``
  (``--prefix-len``, ``--suffix-len``, ``--num-prefixes``) are sent one at a time, each
  generating one token, so the time of each call is its time to first token (TTFT).
  With caching on, the first request of each prefix is cold and the rest are warm; the
  result gives the mean TTFT of caching off, of warm requests with caching on, and their
  ratio.
* ``--mode throughput``: the whole dataset at once (as ``bench throughput``), caching
  off and on alternated ``--repeats`` times; median output tokens/s of each and their
  ratio. With ``--dataset-name random`` (no shared prefix) this is the bookkeeping cost of
  hashing and looking up blocks that never hit.

Example::

    pagedllm bench prefix-caching --model DIR --dtype bfloat16 --dataset-name prefix_repetition \\
        --prefix-len 1024 --suffix-len 64 --num-prefixes 4 --num-prompts 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagedllm.benchmarks.datasets import add_dataset_args, dataset_description, get_samples
from pagedllm.benchmarks.throughput import add_model_args, build_llm, run_pagedllm


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    add_dataset_args(parser, default_input_len=1024, default_output_len=128, seed=False)
    parser.add_argument("--mode", choices=["ttft", "throughput"], default="ttft")
    parser.add_argument("--repeats", type=int, default=3, help="throughput mode: runs per setting")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    parser.add_argument("--output-json", default=None, help="write the results to this JSON file")


def _engines(args: argparse.Namespace) -> dict[bool, Any]:
    engines = {}
    for caching in (False, True):
        engine_args = argparse.Namespace(**vars(args))
        engine_args.enable_prefix_caching = caching
        engines[caching], _ = build_llm(engine_args)
    return engines


def measure_ttft(args: argparse.Namespace) -> dict[str, Any]:
    """Mean TTFT (seconds) of requests sent one at a time, caching off vs on (warm)."""
    from pagedllm.sampling_params import SamplingParams

    engines = _engines(args)
    requests = get_samples(args, engines[False].get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prefix_len = args.prefix_len
    ttft: dict[bool, list[float]] = {False: [], True: []}
    warm: list[float] = []
    seen_prefixes: set[tuple[int, ...]] = set()
    for request in requests:
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        for caching in (False, True):
            start = time.perf_counter()
            output = engines[caching].generate(prompt, params, use_tqdm=False)[0]
            ttft[caching].append(time.perf_counter() - start)
        prefix = tuple(request.prompt_token_ids[:prefix_len])
        if prefix in seen_prefixes:
            warm.append(ttft[True][-1])
            assert output.num_cached_tokens > 0, "a repeated prefix was not served from the cache"
        seen_prefixes.add(prefix)
    cold_mean = statistics.mean(ttft[False])
    warm_mean = statistics.mean(warm) if warm else float("nan")
    return {
        "mode": "ttft",
        "num_requests": len(requests),
        "num_warm_requests": len(warm),
        "mean_ttft_caching_off_s": cold_mean,
        "mean_ttft_caching_on_s": statistics.mean(ttft[True]),
        "mean_ttft_caching_on_warm_s": warm_mean,
        "warm_speedup": cold_mean / warm_mean if warm else float("nan"),
    }


def measure_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Median output tokens/s over ``--repeats`` alternated runs, caching off vs on."""
    engines = _engines(args)
    requests = get_samples(args, engines[False].get_tokenizer())
    runs: dict[bool, list[float]] = {False: [], True: []}
    args.temperature, args.disable_detokenize, args.num_warmups = 0.0, False, 1
    for _ in range(args.repeats):
        for caching in (False, True):
            result = run_pagedllm(args, requests, llm=engines[caching])
            runs[caching].append(result["output_tokens_per_second"])
    off, on = statistics.median(runs[False]), statistics.median(runs[True])
    return {
        "mode": "throughput",
        "num_requests": len(requests),
        "output_tokens_per_second_caching_off": runs[False],
        "output_tokens_per_second_caching_on": runs[True],
        "median_caching_off": off,
        "median_caching_on": on,
        "on_over_off": on / off,
    }


def main(args: argparse.Namespace) -> int:
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    result = measure_ttft(args) if args.mode == "ttft" else measure_throughput(args)
    result.update(benchmark="prefix-caching", model=args.model, dtype=args.dtype, **dataset_description(args))
    for key, value in result.items():
        if isinstance(value, float):
            print(f"{key}: {value:.4f}")
        elif not isinstance(value, list):
            print(f"{key}: {value}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
