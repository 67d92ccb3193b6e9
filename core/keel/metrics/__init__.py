"""Serving metrics: per-iteration latency stats computed in the front end, and stat loggers.

`keel.metrics.stats` is plain Python (no dependencies); `keel.metrics.prometheus` needs
prometheus-client (a dependency of the endpoints plugin) and is imported only by the API server.
"""

from keel.metrics.stats import IterationStats, RequestStatsTracker, StatLogger

__all__ = ["IterationStats", "RequestStatsTracker", "StatLogger"]
