"""A rank's statistics published through ``ray.util.metrics`` (Prometheus via Ray).

Every numeric field of :class:`~hicache_ray.stats.ControllerStats` (and of its nested
cache counters, prefixed ``cache_``) becomes the gauge ``hicache_<field>``, tagged with the
deployment and the rank (low cardinality: never a request id). Counters are published as
gauges of their running totals, so a restarted rank starts again from zero.
"""

from __future__ import annotations

from typing import Any

from hicache_ray.stats import ControllerStats

__all__ = ["StatsPublisher", "flatten_stats"]


def flatten_stats(stats: ControllerStats) -> dict[str, float]:
    """Numeric fields by metric name (``cache_`` for the nested cache counters,
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


class StatsPublisher:
    """Gauges of one rank; made on first use inside the actor (they need a Ray worker)."""

    def __init__(self, deployment: str, rank: int) -> None:
        self.tags = {"deployment": deployment, "rank": str(rank)}
        self._gauges: dict[str, Any] = {}

    def publish(self, stats: ControllerStats) -> None:
        from ray.util.metrics import Gauge

        for name, value in flatten_stats(stats).items():
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = Gauge(
                    f"hicache_{name}",
                    description=f"hicache-ray rank statistic {name}",
                    tag_keys=("deployment", "rank"),
                )
                self._gauges[name] = gauge
            gauge.set(value, tags=self.tags)
