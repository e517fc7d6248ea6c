"""The periodic stats line (vLLM's ``LoggingStatLogger``) and its interval setting."""

from __future__ import annotations

import logging

import pytest

from pagedllm.messages.engine_core import SchedulerStats
from pagedllm.metrics.loggers import PREFIX_CACHE_WINDOW, LoggingStatLogger, log_stats_interval
from pagedllm.metrics.stats import IterationStats

LOGGER = "pagedllm.metrics.loggers"


@pytest.fixture
def records(caplog):
    """``records()``: (level, message) of the test's log records so far."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    return lambda: [(r.levelno, r.getMessage()) for r in caplog.records]


def test_line_averages_over_the_interval(records):
    stat_logger = LoggingStatLogger()
    start = stat_logger.last_log_time
    busy = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=100, prefix_cache_hits=40)
    stat_logger.record(busy, IterationStats(num_prompt_tokens=150, num_generation_tokens=30))
    stat_logger.record(None, IterationStats(num_prompt_tokens=50, num_generation_tokens=20))
    line = stat_logger.log(now=start + 10.0)
    assert line == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 40.0%"
    )
    assert records() == [(logging.INFO, line)]
    # the counts start again; the gauges are the last step's
    stat_logger.record(SchedulerStats(kv_cache_usage=0.0, prefix_cache_queries=100, prefix_cache_hits=100), None)
    line = stat_logger.log(now=start + 12.0)
    assert line.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs")
    assert line.endswith("GPU KV cache usage: 0.0%, Prefix cache hit rate: 70.0%")
    assert records()[-1][0] == logging.INFO  # the interval right after work: still shown
    stat_logger.log(now=start + 14.0)
    assert records()[-1][0] == logging.DEBUG  # idle: kept out of an INFO log


def test_a_data_parallel_engine_names_itself(records):
    stat_logger = LoggingStatLogger(engine_index=1)
    stat_logger.record(SchedulerStats(num_running_reqs=2), IterationStats(num_generation_tokens=8))
    line = stat_logger.log(now=stat_logger.last_log_time + 4.0)
    assert line.startswith("Engine 001: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 2 reqs")
    assert records() == [(logging.INFO, line)]


def test_running_requests_without_new_tokens_are_not_idle(records):
    stat_logger = LoggingStatLogger()
    stat_logger.record(SchedulerStats(num_running_reqs=1), IterationStats())
    stat_logger.log()
    stat_logger.log()
    assert [level for level, _ in records()] == [logging.INFO, logging.INFO]


def test_hit_rate_covers_the_recent_window():
    stat_logger = LoggingStatLogger()
    stat_logger.record(SchedulerStats(prefix_cache_queries=1000, prefix_cache_hits=0), None)
    for _ in range(PREFIX_CACHE_WINDOW):
        stat_logger.record(SchedulerStats(prefix_cache_queries=10, prefix_cache_hits=5), None)
    stat_logger.record(SchedulerStats(), None)  # no lookups: not a window entry
    assert stat_logger.prefix_cache_hit_rate == pytest.approx(0.5)
    assert LoggingStatLogger().prefix_cache_hit_rate == 0.0


def test_interval_from_the_environment(monkeypatch):
    for name in ("PAGEDLLM_LOG_STATS_INTERVAL", "VLLM_LOG_STATS_INTERVAL"):
        monkeypatch.delenv(name, raising=False)
    assert log_stats_interval() == 10.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "3")
    assert log_stats_interval() == 3.0
    monkeypatch.setenv("PAGEDLLM_LOG_STATS_INTERVAL", "0.25")
    assert log_stats_interval() == 0.25
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("PAGEDLLM_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match="PAGEDLLM_LOG_STATS_INTERVAL must be a positive number of seconds"):
            log_stats_interval()


def test_the_second_kv_tier_has_its_own_hit_rate_on_the_line():
    stat_logger = LoggingStatLogger()
    assert "External" not in stat_logger.log(now=stat_logger.last_log_time + 1.0)
    stat_logger.record(SchedulerStats(prefix_cache_queries=200, prefix_cache_hits=50,
                                      external_prefix_cache_queries=200, external_prefix_cache_hits=96), None)
    line = stat_logger.log(now=stat_logger.last_log_time + 1.0)
    assert line.endswith("Prefix cache hit rate: 25.0%, External prefix cache hit rate: 48.0%")
