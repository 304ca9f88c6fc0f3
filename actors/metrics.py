"""A rank's metrics, published through ``ray.util.metrics`` (Prometheus via Ray).

What is published is :data:`hicache_ray.base.metrics.METRICS`: counters from the running totals
of :class:`~hicache_ray.base.stats.ControllerStats` (each publish adds what grew since the last),
gauges from its levels, histograms from each finished request (rank 0) and each step.
"""

from __future__ import annotations

from typing import Any

from hicache_ray.base.metrics import METRICS, SECONDS_BUCKETS, Metric
from hicache_ray.base.stats import ControllerStats
from hicache_ray.engine.request import RequestResult

__all__ = ["StatsPublisher", "flatten_stats"]

_TAGS = ("deployment", "rank")


def flatten_stats(stats: ControllerStats) -> dict[str, float]:
    """Numeric fields by source name (``cache_`` for the nested cache counters,
    ``unfulfilled_tokens_<reason>`` for the per-reason counts)."""
    out: dict[str, float] = {}
    for name in stats.__struct_fields__:
        value = getattr(stats, name)
        if name == "cache":
            for sub in value.__struct_fields__:
                if isinstance(getattr(value, sub), int | float):
                    out[f"cache_{sub}"] = float(getattr(value, sub))
        elif isinstance(value, dict):
            for reason, count in value.items():
                out[f"{name}_{reason}"] = float(count)
        elif isinstance(value, int | float):
            out[name] = float(value)
    return out


def _applies(metric: Metric, result: RequestResult) -> bool:
    """Whether a finished request has a value for a per-request histogram."""
    if result.error is not None:
        return False
    if metric.source == "prefetch_s":
        return result.prefetch_bytes > 0 or result.storage_hit_tokens > 0
    if metric.source == "load_s":
        return result.load_bytes > 0
    if metric.source == "ttft_s":
        return bool(result.output_tokens)
    return True


class StatsPublisher:
    """One rank's metrics; made on first use inside the actor (they need a Ray worker).
    Called from the step thread only."""

    def __init__(self, deployment: str, rank: int) -> None:
        self.tags = {"deployment": deployment, "rank": str(rank)}
        self._made: dict[str, Any] = {}
        self._totals: dict[str, float] = {}
        histograms = [m for m in METRICS if m.kind == "histogram"]
        self._per_request = [m for m in histograms if hasattr(RequestResult, m.source)]
        self._per_step = [m for m in histograms if m.source == "step"]

    def _get(self, metric: Metric) -> Any:
        made = self._made.get(metric.name)
        if made is None:
            from ray.util.metrics import Counter, Gauge, Histogram

            if metric.kind == "counter":
                made = Counter(metric.name, description=metric.help, tag_keys=_TAGS)
            elif metric.kind == "gauge":
                made = Gauge(metric.name, description=metric.help, tag_keys=_TAGS)
            else:
                made = Histogram(
                    metric.name,
                    description=metric.help,
                    boundaries=list(SECONDS_BUCKETS),
                    tag_keys=_TAGS,
                )
            self._made[metric.name] = made
        return made

    def publish(self, stats: ControllerStats, queued: int | None = None) -> None:
        """Counters and gauges from ``stats`` (and rank 0's admission ``queued``)."""
        flat = flatten_stats(stats)
        if queued is not None:
            flat["queued"] = float(queued)
        for metric in METRICS:
            value = flat.get(metric.source)
            if metric.kind == "histogram" or value is None:
                continue
            if metric.kind == "gauge":
                self._get(metric).set(value, tags=self.tags)
                continue
            counter = self._get(metric)
            if metric.name not in self._totals:
                # Every series exists from the first publish, at zero: an alert on the rate
                # of failures sees it before the first failure. (Ray's ``inc`` refuses 0.)
                counter._record(0.0, tags=self.tags)
                self._totals[metric.name] = 0.0
            grown = value - self._totals[metric.name]
            if grown > 0:
                counter.inc(grown, tags=self.tags)
                self._totals[metric.name] = value

    def observe_result(self, result: RequestResult) -> None:
        for metric in self._per_request:
            if _applies(metric, result):
                self._get(metric).observe(getattr(result, metric.source), tags=self.tags)

    def observe_step(self, seconds: float) -> None:
        for metric in self._per_step:
            self._get(metric).observe(seconds, tags=self.tags)
