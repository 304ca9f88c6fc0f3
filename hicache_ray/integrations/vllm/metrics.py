"""The vLLM connector's counters through vLLM's own stats path and ``/metrics``.

Each worker reports what it moved since its last report (:class:`MovedTokens`); vLLM sums
the workers' reports and hands them to :class:`ConnectorProm`, which adds them to one
Prometheus counter per :data:`~hicache_ray.base.metrics.CONNECTOR_METRICS` entry, with vLLM's
labels. The scheduler side's hit count is vLLM's own ``vllm:external_prefix_cache_hits``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from hicache_ray.base.metrics import CONNECTOR_METRICS

__all__ = ["ConnectorProm", "MovedTokens", "WORKER_FIELDS"]

# ConnectorStats fields a worker reports (the scheduler side's hits are vLLM's own metric)
WORKER_FIELDS = ("loaded_tokens", "load_failed_tokens", "saved_tokens", "save_dropped_tokens")


class MovedTokens(KVConnectorStats):  # type: ignore[misc]  # vllm has no types here
    """Tokens moved since the last report, by :data:`WORKER_FIELDS` name."""

    def reset(self) -> None:
        self.data = dict.fromkeys(WORKER_FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in WORKER_FIELDS:
            self.data[name] = self.data.get(name, 0) + int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(self.data.get(name, 0)) for name in WORKER_FIELDS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in WORKER_FIELDS)


class ConnectorProm(KVConnectorPromMetrics):  # type: ignore[misc]
    """One Prometheus counter per worker field, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for metric in CONNECTOR_METRICS:
            if metric.source not in WORKER_FIELDS:
                continue
            counter = self._counter_cls(
                name=metric.name.removesuffix("_total"),
                documentation=metric.help,
                labelnames=labelnames,
            )
            self._counters[metric.source] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = int(transfer_stats_data.get(name, 0))
            if value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
