"""Serving metrics: per-iteration latency stats computed in the front end, and stat loggers.

`keel.metrics.stats` is plain Python (no dependencies): the `StatLogger` protocol and the stats it
receives. Concrete loggers are plugins (`stat_logger` kind), e.g. the endpoints plugin's "prometheus".
"""

from keel.metrics.stats import IterationStats, RequestStatsTracker, StatLogger

__all__ = ["IterationStats", "RequestStatsTracker", "StatLogger"]
