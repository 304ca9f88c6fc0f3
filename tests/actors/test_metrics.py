"""Rank statistics as metric names (what the rank actors publish through ray.util.metrics)."""

from __future__ import annotations

from actors.metrics import flatten_stats
from hicache_ray.stats import CacheStats, ControllerStats


def test_every_numeric_statistic_gets_a_flat_name() -> None:
    stats = ControllerStats(cache=CacheStats(device_hit_tokens=7), steps=3, pending_backups=2)
    stats.unfulfilled_tokens["read_failed"] = 5
    flat = flatten_stats(stats)
    assert flat["steps"] == 3 and flat["pending_backups"] == 2
    assert flat["cache_device_hit_tokens"] == 7
    assert flat["unfulfilled_tokens_read_failed"] == 5
    assert all(isinstance(v, float) for v in flat.values())
    assert "cache" not in flat and "unfulfilled_tokens" not in flat
