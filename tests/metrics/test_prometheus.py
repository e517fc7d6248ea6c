"""Request statistics and their Prometheus export: exact times on synthetic outputs,
exact counts after real requests of known sizes, vLLM's names under ``pagedllm:``."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.messages.engine_core import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
)
from pagedllm.metrics.prometheus import PrometheusStatLogger, build_1_2_5_buckets, build_iteration_buckets
from pagedllm.metrics.stats import IterationStats, RequestStatsTracker

GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
COUNTERS = [
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
]
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
    "request_params_n",
    "request_params_max_tokens",
]
MODEL = "tiny"


def families(registry: CollectorRegistry) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    labels = {"model_name": MODEL, "engine": "0", **labels}
    return registry.get_sample_value(f"pagedllm:{name}", labels) or 0.0


def output(request_id, tokens, finish=None, events=None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, tokens, finish_reason=finish, events=events)


def test_tracker_times_are_exact():
    tracker = RequestStatsTracker()
    tracker.add_request("a", arrival_time=100.0, num_prompt_tokens=5, max_tokens=3)
    events = [
        EngineCoreEvent(EngineCoreEventType.QUEUED, 100.5),
        EngineCoreEvent(EngineCoreEventType.SCHEDULED, 101.0),
    ]
    first = tracker.update_from_outputs(
        EngineCoreOutputs([output("a", [7], events=events)], timestamp=101.5), now=101.6
    )
    assert first.num_prompt_tokens == 5 and first.num_generation_tokens == 1
    assert first.time_to_first_tokens_iter == [pytest.approx(1.6)] and first.inter_token_latencies_iter == []
    second = tracker.update_from_outputs(
        EngineCoreOutputs([output("a", [8]), output("gone", [1])], timestamp=102.0), now=102.1
    )
    assert second.num_prompt_tokens == 0 and second.num_generation_tokens == 1  # unknown ids ignored
    assert second.inter_token_latencies_iter == [pytest.approx(0.5)]
    last = tracker.update_from_outputs(
        EngineCoreOutputs([output("a", [9], FinishReason.LENGTH)], timestamp=102.5), now=102.7
    )
    tracker.finish_request("a", "length", 102.7, last)
    (finished,) = last.finished_requests
    assert finished.finished_reason == "length"
    assert finished.e2e_latency == pytest.approx(2.7)
    assert finished.queued_time == pytest.approx(0.5)
    assert finished.prefill_time == pytest.approx(0.5)
    assert finished.decode_time == pytest.approx(1.0)
    assert (finished.num_prompt_tokens, finished.num_generation_tokens) == (5, 3)
    assert last.n_params_iter == [1] and last.max_tokens_params_iter == [3]
    assert not tracker.requests


def test_tracker_counts_n_once_per_user_request_and_aborts_unscheduled():
    tracker = RequestStatsTracker()
    for i in range(2):
        tracker.add_request(f"{i}_p", 10.0, 4, parent_id="p", n=2, max_tokens=8)
    stats = IterationStats()
    tracker.finish_request("0_p", "stop", 11.0, stats)
    assert stats.n_params_iter == []  # one child still running
    tracker.finish_request("1_p", "abort", 12.0, stats)
    assert stats.n_params_iter == [2] and stats.max_tokens_params_iter == [8]
    aborted = stats.finished_requests[1]
    assert aborted.queued_time == pytest.approx(2.0)  # never scheduled: waited until aborted
    assert aborted.prefill_time == aborted.decode_time == 0.0


def test_logger_records_exactly_and_registries_are_independent(tiny_llama):
    config = EngineArgs(model=str(tiny_llama), max_num_batched_tokens=512).create_engine_config()
    registries = [CollectorRegistry(), CollectorRegistry()]
    loggers = [PrometheusStatLogger(r, MODEL, config, num_gpu_blocks=123) for r in registries]
    stats = IterationStats(num_prompt_tokens=7, num_generation_tokens=3, num_scheduled_tokens=9)
    stats.time_to_first_tokens_iter = [0.2]
    tracker = RequestStatsTracker()
    tracker.add_request("x", 0.0, 7, n=1, max_tokens=16)
    tracker.finish_request("x", "stop", 1.0, stats)
    scheduler_stats = SchedulerStats(
        2, 1, 0.25, prefix_cache_queries=32, prefix_cache_hits=16, num_preemptions=1,
        external_prefix_cache_queries=32, external_prefix_cache_hits=8,
    )
    loggers[0].record(scheduler_stats, stats)
    loggers[0].record(SchedulerStats(), None)
    r = registries[0]
    assert value(r, "num_requests_running") == 0 and value(r, "kv_cache_usage_perc") == 0
    assert value(r, "prompt_tokens_total") == 7 and value(r, "generation_tokens_total") == 3
    assert value(r, "num_preemptions_total") == 1
    assert value(r, "prefix_cache_queries_total") == 32 and value(r, "prefix_cache_hits_total") == 16
    assert value(r, "external_prefix_cache_queries_total") == 32 and value(r, "external_prefix_cache_hits_total") == 8
    assert value(r, "request_success_total", finished_reason="stop") == 1
    assert value(r, "request_success_total", finished_reason="length") == 0
    assert value(r, "iteration_tokens_total_count") == 1 and value(r, "iteration_tokens_total_sum") == 9
    assert value(r, "time_to_first_token_seconds_count") == 1
    assert value(r, "request_params_max_tokens_sum") == 16
    assert value(registries[1], "prompt_tokens_total") == 0  # the other registry is untouched
    info = r.get_sample_value(
        "pagedllm:cache_config_info",
        {
            "block_size": "16",
            "gpu_memory_utilization": "0.9",
            "kv_cache_memory_bytes": "None",
            "enable_prefix_caching": "True",
            "prefix_caching_hash_algo": "sha256",
            "num_gpu_blocks": "123",
            "cache_dtype": str(config.model_config.dtype).replace("torch.", ""),
            "engine": "0",
        },
    )
    assert info == 1
    # every vLLM V1 name is there, with the prefix and the model_name and engine labels
    found = families(r)
    for name in GAUGES + COUNTERS + HISTOGRAMS:
        family = found[f"pagedllm:{name}"]
        assert all(s.labels["model_name"] == MODEL and s.labels["engine"] == "0" for s in family.samples), name
    assert found["pagedllm:cache_config_info"].type == "gauge"
    assert not any(n.endswith("_created") for f in found.values() for n in (s.name for s in f.samples))


def test_each_engine_has_its_own_series(tiny_llama):
    """Data-parallel replicas: every engine's series exists from the start (label ``engine``,
    vLLM's), and a step's statistics go to its engine only."""
    config = EngineArgs(model=str(tiny_llama), max_num_batched_tokens=512).create_engine_config()
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(registry, MODEL, config, engine_indexes=range(2))
    assert value(registry, "generation_tokens_total", engine="1") == 0
    assert registry.get_sample_value("pagedllm:generation_tokens_total", {"model_name": MODEL, "engine": "1"}) == 0
    logger.record(SchedulerStats(3, 1, 0.5), IterationStats(num_generation_tokens=5), engine_index=1)
    logger.record(SchedulerStats(1, 0, 0.25), IterationStats(num_generation_tokens=2), engine_index=0)
    assert value(registry, "generation_tokens_total", engine="1") == 5
    assert value(registry, "generation_tokens_total", engine="0") == 2
    assert value(registry, "num_requests_running", engine="1") == 3
    assert value(registry, "kv_cache_usage_perc", engine="0") == 0.25
    engines = {s.labels["engine"] for s in families(registry)["pagedllm:cache_config_info"].samples}
    assert engines == {"0", "1"}


def test_bucket_builders():
    assert build_1_2_5_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_iteration_buckets(512) == [1, 8, 16, 32, 64, 128, 256, 512]


def test_counts_exact_after_requests_of_known_sizes(tiny_llama):
    """Real requests (engine in a thread): token counters, request counters and every
    histogram's count and sum match the requests' sizes exactly."""
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory_bytes=8 << 20),
        multiprocess=False,
        served_model_name=MODEL,
    )
    prompt_lengths = [3, 5, 17, 33, 64]
    max_tokens = [4, 7, 1, 12, 5]
    # distinct first tokens: no prefix-cache hits, so the engine computes every prompt token
    prompts = [
        [100 + i] + [7 + (i * 31 + j) % 900 for j in range(n - 1)] for i, n in enumerate(prompt_lengths)
    ]

    async def run(prompt, params, request_id):
        async for out in llm.generate({"prompt_token_ids": prompt}, params, request_id):
            last = out
        return last

    async def main():
        await asyncio.gather(
            *[
                run(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True), f"r{i}")
                for i, (p, m) in enumerate(zip(prompts, max_tokens))
            ]
        )
        # n = 2: two engine requests, one user request
        await run(
            [200, 201, 202, 203], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=2), "n2"
        )
        # (before the stop-string request: the engine may run a step or two past a stop
        # string before the front end's abort arrives, which only iteration_tokens sees)
        iteration_tokens.append(value(llm.metrics_registry, "iteration_tokens_total_sum"))
        # a stop string found in the greedy output finishes the request as "stop"
        probe = await run(
            [300, 301, 302], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), "probe"
        )
        text, token_ids = probe.outputs[0].text, probe.outputs[0].token_ids
        stop = text[len(text) // 2 :][:2]
        stopped = await run(
            [300, 301, 302],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop]),
            "stop",
        )
        # the engine learns of the stop string through an abort; its stats follow within a step
        for _ in range(100):
            if value(llm.metrics_registry, "num_requests_running") == 0:
                break
            await asyncio.sleep(0.01)
        return stopped, token_ids

    iteration_tokens: list[float] = []
    try:
        stopped, probe_tokens = asyncio.run(main())
    finally:
        llm.shutdown()
    r = llm.metrics_registry
    assert stopped.outputs[0].finish_reason == "stop"
    num_stop_tokens = len(stopped.outputs[0].token_ids)
    # the engine generated up to the token that completed the stop string
    gen_stop = next(
        k
        for k in range(1, 9)
        if llm.tokenizer.decode(probe_tokens[:k]).find(stopped.outputs[0].stop_reason) >= 0
    )
    assert num_stop_tokens <= gen_stop

    prompt_total = sum(prompt_lengths) + 2 * 4 + 3 + 3
    gen_total = sum(max_tokens) + 2 * 3 + 8 + gen_stop
    num_engine_requests = len(prompts) + 2 + 2
    assert value(r, "prompt_tokens_total") == prompt_total
    assert value(r, "generation_tokens_total") == gen_total
    assert value(r, "request_success_total", finished_reason="length") == len(prompts) + 2 + 1
    assert value(r, "request_success_total", finished_reason="stop") == 1
    assert value(r, "request_success_total", finished_reason="abort") == 0
    for name in ["time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"]:  # fmt: skip
        assert value(r, f"{name}_count") == num_engine_requests, name
    assert value(r, "request_prompt_tokens_count") == num_engine_requests
    assert value(r, "request_prompt_tokens_sum") == prompt_total
    assert value(r, "request_generation_tokens_sum") == gen_total
    # one inter-token latency per token after the first (one token per step)
    assert value(r, "inter_token_latency_seconds_count") == gen_total - num_engine_requests
    assert value(r, "request_params_n_count") == len(prompts) + 3
    assert value(r, "request_params_n_sum") == len(prompts) + 2 + 1 + 1
    assert value(r, "request_params_max_tokens_sum") == sum(max_tokens) + 3 + 8 + 8
    # no prompt shares a full block with another: no prefix-cache hits, so the engine
    # computed each prompt token once and each generated token but the last
    assert value(r, "prefix_cache_hits_total") == 0
    assert value(r, "prefix_cache_queries_total") >= sum(prompt_lengths)
    num_before_stop = len(prompts) + 2
    tokens_before_stop = sum(prompt_lengths) + 2 * 4 + sum(max_tokens) + 2 * 3
    assert iteration_tokens[0] == tokens_before_stop - num_before_stop
    assert value(r, "num_requests_running") == value(r, "num_requests_waiting") == 0
    assert value(r, "kv_cache_usage_perc") == 0
