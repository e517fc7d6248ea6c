"""Prometheus metrics with vLLM V1's names under the prefix ``pagedllm:`` (a vLLM Grafana
dashboard works after replacing ``vllm:`` with ``pagedllm:``).

Every metric lives in the ``CollectorRegistry`` given to ``PrometheusStatLogger`` (one
per ``AsyncLLM``: ``AsyncLLM.metrics_registry``); render it with
``prometheus_client.generate_latest(registry)``. All but ``cache_config_info`` and ``lora_requests_info`` carry the
labels ``model_name`` and ``engine`` (the data-parallel replica, "0" without replicas; vLLM's
labels), ``cache_config_info`` the label ``engine``.

=============================================  =========  ==========================================
name (as rendered)                              type       meaning (unit)
=============================================  =========  ==========================================
pagedllm:num_requests_running                   gauge      engine requests running (last step)
pagedllm:num_requests_waiting                   gauge      engine requests waiting or preempted
pagedllm:kv_cache_usage_perc                    gauge      fraction of KV blocks in use, 0-1
pagedllm:cache_config_info                      gauge      1; labels: the cache configuration
pagedllm:prompt_tokens_total                    counter    prompt tokens of requests that produced
                                                           their first token (tokens)
pagedllm:generation_tokens_total                counter    generated tokens
pagedllm:request_success_total                  counter    finished engine requests; label
                                                           finished_reason = stop | length | abort
pagedllm:num_preemptions_total                  counter    preemptions
pagedllm:prefix_cache_queries_total             counter    prompt tokens looked up in the prefix cache
pagedllm:prefix_cache_hits_total                counter    of those, tokens found
pagedllm:external_prefix_cache_queries_total    counter    prompt tokens of requests looked up in the
                                                           second KV tier (--kv-offloading-size)
pagedllm:external_prefix_cache_hits_total       counter    tokens found there (loaded back)
pagedllm:time_to_first_token_seconds            histogram  per engine request
pagedllm:inter_token_latency_seconds            histogram  per output after the first
pagedllm:e2e_request_latency_seconds            histogram  per finished engine request
pagedllm:request_queue_time_seconds             histogram  per finished engine request
pagedllm:request_prefill_time_seconds           histogram  per finished engine request
pagedllm:request_decode_time_seconds            histogram  per finished engine request
pagedllm:request_prompt_tokens                  histogram  per finished engine request (tokens)
pagedllm:request_generation_tokens              histogram  per finished engine request (tokens)
pagedllm:iteration_tokens_total                 histogram  tokens computed per engine step
pagedllm:request_params_n                       histogram  per finished user request
pagedllm:request_params_max_tokens              histogram  per finished user request (tokens)
pagedllm:lora_requests_info                     gauge      with --enable-lora: the time (s since the
                                                           epoch) of the last step; labels max_lora,
                                                           running_lora_adapters, waiting_lora_adapters
                                                           (comma-separated adapter names), as vLLM's
=============================================  =========  ==========================================

With speculative decoding, the ``spec_decode_*`` counters of ``pagedllm.metrics.spec_decode`` too.

"Engine request": each of the ``n`` completions of a request counts once (as vLLM V1);
see ``pagedllm.metrics.stats`` for the exact definitions of the times.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.config import EngineConfig
from pagedllm.messages.engine_core import SchedulerStats
from pagedllm.metrics.spec_decode import SpecDecodingProm
from pagedllm.metrics.stats import IterationStats

PREFIX = "pagedllm:"
FINISHED_REASONS = ("stop", "length", "abort")

# Buckets as vLLM V1 uses them (seconds).
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (inclusive)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def build_iteration_buckets(max_num_batched_tokens: int) -> list[int]:
    """1, 8, 16, 32, ... (powers of two) below the step budget, then the budget itself."""
    buckets = [1] + [2**k for k in range(3, 31) if 2**k < max_num_batched_tokens]
    if max_num_batched_tokens > 1:
        buckets.append(max_num_batched_tokens)
    return buckets


class PrometheusStatLogger:
    """Creates the metrics in ``registry`` and updates them from engine statistics.

    Every series carries the labels ``model_name`` and ``engine`` (the data-parallel replica's
    index as a string, "0" without replicas), as vLLM V1's; a series exists for each engine from
    the start.

    Args:
        registry: where the metrics are registered (must not hold them already).
        model_name: value of the ``model_name`` label (the served model name).
        config: for the cache configuration and the bucket limits (``max_model_len``,
            ``max_num_batched_tokens``).
        engine_indexes: the engines whose statistics ``record`` receives.
        num_gpu_blocks: the KV-cache blocks (the engine client's ``num_gpu_blocks``), a label
            of ``cache_config_info``.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        config: EngineConfig,
        engine_indexes: Iterable[int] = (0,),
        num_gpu_blocks: Optional[int] = None,
    ) -> None:
        # NOTE: as vLLM: no ``*_created`` series (process-wide prometheus_client setting).
        prometheus_client.disable_created_metrics()
        self.registry = registry
        families = _Families(registry, config)
        spec = config.speculative_config
        spec_decoding = None if spec is None else SpecDecodingProm(registry, PREFIX, spec.num_speculative_tokens)
        self.engines = {
            index: _EngineSeries(families, spec_decoding, [model_name, str(index)]) for index in engine_indexes
        }
        self._log_cache_config(config, model_name, num_gpu_blocks)
        self.max_lora = None if config.lora_config is None else str(config.lora_config.max_loras)
        self.gauge_lora_info = None if self.max_lora is None else Gauge(
            PREFIX + "lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry,
        )  # fmt: skip

    def _record_lora(self, stats: SchedulerStats) -> None:
        """One sample for the adapters of this step (the previous label set is dropped)."""
        if self.gauge_lora_info is None:
            return
        self.gauge_lora_info.clear()
        self.gauge_lora_info.labels(
            max_lora=self.max_lora,
            waiting_lora_adapters=",".join(stats.waiting_lora_adapters),
            running_lora_adapters=",".join(stats.running_lora_adapters),
        ).set_to_current_time()

    def _log_cache_config(self, config: EngineConfig, model_name: str, num_gpu_blocks: Optional[int]) -> None:
        cache = config.cache_config
        info = {
            "block_size": cache.block_size,
            "gpu_memory_utilization": cache.gpu_memory_utilization,
            "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "prefix_caching_hash_algo": cache.prefix_caching_hash_algo,
            "num_gpu_blocks": num_gpu_blocks,
            "cache_dtype": cache.cache_dtype_name(config.model_config.dtype),
        }
        gauge = Gauge(
            PREFIX + "cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            [*info, "engine"],
            registry=self.registry,
        )
        for index in self.engines:
            gauge.labels(**{k: str(v) for k, v in info.items()}, engine=str(index)).set(1)

    def record(
        self,
        scheduler_stats: Optional[SchedulerStats],
        iteration_stats: Optional[IterationStats],
        engine_index: int = 0,
    ) -> None:
        """Update engine ``engine_index``'s series with one step's scheduler and iteration
        statistics."""
        if scheduler_stats is not None:
            self._record_lora(scheduler_stats)
        self.engines[engine_index].record(scheduler_stats, iteration_stats)


class _Families:
    """The metric families with the labels ``model_name`` and ``engine`` (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, config: EngineConfig) -> None:
        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=registry)

        self.gauge_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.gauge_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.gauge_kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.counter_prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.counter_generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.counter_preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.counter_prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.counter_prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.counter_external_prefix_queries = counter(
            "external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens.",
        )
        self.counter_external_prefix_hits = counter(
            "external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
            "cached tokens.",
        )
        self.counter_success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=registry,
        )
        self.hist_ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.hist_itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.hist_e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.hist_queue = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.hist_prefill = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.hist_decode = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        token_buckets = build_1_2_5_buckets(config.model_config.max_model_len)
        self.hist_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.hist_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.hist_iteration_tokens = histogram(
            "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            build_iteration_buckets(config.scheduler_config.max_num_batched_tokens),
        )
        self.hist_n = histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.hist_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )


class _EngineSeries:
    """One engine's series of every family (label values ``[model_name, engine]``)."""

    def __init__(self, families: _Families, spec_decoding: Optional[SpecDecodingProm], label_values: list[str]) -> None:
        def bind(family: Any) -> Any:
            return family.labels(*label_values)

        self.gauge_running = bind(families.gauge_running)
        self.gauge_waiting = bind(families.gauge_waiting)
        self.gauge_kv_usage = bind(families.gauge_kv_usage)
        self.counter_prompt_tokens = bind(families.counter_prompt_tokens)
        self.counter_generation_tokens = bind(families.counter_generation_tokens)
        self.counter_preemptions = bind(families.counter_preemptions)
        self.counter_prefix_queries = bind(families.counter_prefix_queries)
        self.counter_prefix_hits = bind(families.counter_prefix_hits)
        self.counter_external_prefix_queries = bind(families.counter_external_prefix_queries)
        self.counter_external_prefix_hits = bind(families.counter_external_prefix_hits)
        self.counter_success = {
            reason: families.counter_success.labels(*label_values, reason) for reason in FINISHED_REASONS
        }
        self.hist_ttft = bind(families.hist_ttft)
        self.hist_itl = bind(families.hist_itl)
        self.hist_e2e = bind(families.hist_e2e)
        self.hist_queue = bind(families.hist_queue)
        self.hist_prefill = bind(families.hist_prefill)
        self.hist_decode = bind(families.hist_decode)
        self.hist_prompt_tokens = bind(families.hist_prompt_tokens)
        self.hist_generation_tokens = bind(families.hist_generation_tokens)
        self.hist_iteration_tokens = bind(families.hist_iteration_tokens)
        self.hist_n = bind(families.hist_n)
        self.hist_max_tokens = bind(families.hist_max_tokens)
        self.spec_decoding = None if spec_decoding is None else spec_decoding.series(label_values)

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats]) -> None:
        if scheduler_stats is not None:
            self.gauge_running.set(scheduler_stats.num_running_reqs)
            self.gauge_waiting.set(scheduler_stats.num_waiting_reqs)
            self.gauge_kv_usage.set(scheduler_stats.kv_cache_usage)
            self.counter_preemptions.inc(scheduler_stats.num_preemptions)
            self.counter_prefix_queries.inc(scheduler_stats.prefix_cache_queries)
            self.counter_prefix_hits.inc(scheduler_stats.prefix_cache_hits)
            self.counter_external_prefix_queries.inc(scheduler_stats.external_prefix_cache_queries)
            self.counter_external_prefix_hits.inc(scheduler_stats.external_prefix_cache_hits)
            if self.spec_decoding is not None and scheduler_stats.spec_decoding_stats is not None:
                self.spec_decoding.observe(scheduler_stats.spec_decoding_stats)
        if iteration_stats is None:
            return
        self.counter_prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.counter_generation_tokens.inc(iteration_stats.num_generation_tokens)
        if iteration_stats.num_scheduled_tokens > 0:
            self.hist_iteration_tokens.observe(iteration_stats.num_scheduled_tokens)
        for ttft in iteration_stats.time_to_first_tokens_iter:
            self.hist_ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            self.hist_itl.observe(itl)
        for finished in iteration_stats.finished_requests:
            self.counter_success[finished.finished_reason].inc()
            self.hist_e2e.observe(finished.e2e_latency)
            self.hist_queue.observe(finished.queued_time)
            self.hist_prefill.observe(finished.prefill_time)
            self.hist_decode.observe(finished.decode_time)
            self.hist_prompt_tokens.observe(finished.num_prompt_tokens)
            self.hist_generation_tokens.observe(finished.num_generation_tokens)
        for n in iteration_stats.n_params_iter:
            self.hist_n.observe(n)
        for max_tokens in iteration_stats.max_tokens_params_iter:
            self.hist_max_tokens.observe(max_tokens)
