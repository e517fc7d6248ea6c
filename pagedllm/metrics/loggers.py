"""``LoggingStatLogger``: the periodic one-line summary of the engine that vLLM logs
(vLLM V1's ``LoggingStatLogger``), from the same statistics as the Prometheus metrics::

    Avg prompt throughput: 120.3 tokens/s, Avg generation throughput: 48.0 tokens/s,
    Running: 3 reqs, Waiting: 0 reqs, GPU KV cache usage: 4.2%, Prefix cache hit rate: 37.5%

(with speculative decoding, followed by ", Spec decode acceptance rate: 62.5%, Mean
acceptance length: 3.50" for the steps of the interval; see ``pagedllm.metrics.spec_decode``)

The server logs it every ``log_stats_interval()`` seconds (``PAGEDLLM_LOG_STATS_INTERVAL``,
else vLLM's ``VLLM_LOG_STATS_INTERVAL``, default 10) unless ``--disable-log-stats``. The
throughputs are averages over the time since the previous line; prompt tokens count when a
request's first token arrives (as vLLM). The hit rate covers the prefix-cache lookups of the
last ``PREFIX_CACHE_WINDOW`` engine steps that looked anything up. While the engine is idle
(no tokens in this interval nor the previous one, nothing running or waiting) the line goes
to DEBUG, so an idle server's log stays quiet.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Iterable, Optional

from pagedllm import envs
from pagedllm.messages.engine_core import SchedulerStats
from pagedllm.metrics.spec_decode import SpecDecodingLogging
from pagedllm.metrics.stats import IterationStats

logger = logging.getLogger(__name__)

#: Engine steps with prefix-cache lookups that the hit rate covers.
PREFIX_CACHE_WINDOW = 1000


def log_stats_interval() -> float:
    """Seconds between two stats lines: ``PAGEDLLM_LOG_STATS_INTERVAL``, else vLLM's
    ``VLLM_LOG_STATS_INTERVAL``, else 10 (vLLM's default; ``pagedllm.envs``).

    Raises:
        ValueError: the variable is not a positive number.
    """
    return envs.PAGEDLLM_LOG_STATS_INTERVAL.get()


class LoggingStatLogger:
    """Accumulates engine statistics (``record``) and logs vLLM's summary line (``log``).

    Times are ``time.monotonic()`` seconds; token counts are tokens. ``engine_index``: with
    data-parallel replicas, one logger per engine, whose line starts "Engine 001: " (as vLLM's);
    None for the one engine.
    """

    def __init__(self, engine_index: Optional[int] = None) -> None:
        self.prefix = "" if engine_index is None else f"Engine {engine_index:03d}: "
        self.last_log_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_scheduler_stats = SchedulerStats()
        self._last_was_busy = False
        self._prefix_window: collections.deque[tuple[int, int]] = collections.deque(maxlen=PREFIX_CACHE_WINDOW)
        # The same for the second KV tier (empty without one: the line then leaves it out).
        self._external_window: collections.deque[tuple[int, int]] = collections.deque(maxlen=PREFIX_CACHE_WINDOW)
        self.spec_decoding = SpecDecodingLogging()

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats]) -> None:
        """Account one engine step's statistics (either may be None)."""
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
            if scheduler_stats.prefix_cache_queries:
                self._prefix_window.append((scheduler_stats.prefix_cache_queries, scheduler_stats.prefix_cache_hits))
            if scheduler_stats.external_prefix_cache_queries:
                self._external_window.append((scheduler_stats.external_prefix_cache_queries,
                                              scheduler_stats.external_prefix_cache_hits))
            if scheduler_stats.spec_decoding_stats is not None:
                self.spec_decoding.observe(scheduler_stats.spec_decoding_stats)
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queried tokens over the window, 0-1 (0 before any lookup)."""
        return _hit_rate(self._prefix_window)

    @property
    def external_prefix_cache_hit_rate(self) -> float:
        """The same for the second KV tier's lookups."""
        return _hit_rate(self._external_window)

    def log(self, now: Optional[float] = None) -> str:
        """Log the line for the time since the previous call (INFO, or DEBUG while idle),
        reset the token counts, and return the line."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.last_log_time, 1e-9)
        prompt_throughput = self.num_prompt_tokens / elapsed
        generation_throughput = self.num_generation_tokens / elapsed
        stats = self.last_scheduler_stats
        busy = bool(self.num_prompt_tokens or self.num_generation_tokens or stats.num_running_reqs or stats.num_waiting_reqs)
        level = logging.INFO if busy or self._last_was_busy else logging.DEBUG
        line = (
            f"{self.prefix}Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
            f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
            f"GPU KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {self.prefix_cache_hit_rate * 100:.1f}%"
        )
        if self._external_window:
            line += f", External prefix cache hit rate: {self.external_prefix_cache_hit_rate * 100:.1f}%"
        spec_line = self.spec_decoding.line()
        if spec_line is not None:
            line += ", " + spec_line
        logger.log(level, "%s", line)
        self._last_was_busy = busy
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.last_log_time = now
        return line


def _hit_rate(window: Iterable[tuple[int, int]]) -> float:
    """Hits / queried tokens of a window of (queries, hits), 0-1 (0 before any lookup)."""
    pairs = list(window)
    queries = sum(q for q, _ in pairs)
    return sum(h for _, h in pairs) / queries if queries else 0.0
