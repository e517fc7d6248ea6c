"""Engine statistics and their Prometheus export (see ``prometheus`` for the metric names)."""

from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats, RequestStatsTracker

__all__ = ["PrometheusStatLogger", "IterationStats", "FinishedRequestStats", "RequestStatsTracker"]
