"""Metrics: one list (hicache_ray.base.metrics.METRICS) defines them, the rank publishes exactly
those with their Prometheus types, and the docs table is generated from the same list."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from actors.metrics import flatten_stats
from hicache_ray.base.metrics import METRICS, markdown_table
from hicache_ray.base.stats import CacheStats, ControllerStats
from hicache_ray.engine.request import GenerateRequest
from tests.actors.helpers import MODEL, cache_config, prompt, store_name
from tests.helpers import wait_until

ray = pytest.importorskip("ray")
actors = pytest.importorskip("actors")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_every_statistic_is_a_metric_and_names_follow_prometheus() -> None:
    stats = ControllerStats(cache=CacheStats(device_hit_tokens=7), steps=3, pending_backups=2)
    flat = flatten_stats(stats)
    sources = {m.source for m in METRICS if m.kind != "histogram"}
    assert set(flat) == sources - {"queued"}  # nothing published twice, nothing left out
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert re.fullmatch(r"hicache_[a-z0-9_]+", m.name), m.name
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert re.search(r"\((seconds|bytes|tokens|pages|[a-z]+s)\)$", m.help), m.help
        if m.kind == "histogram" or "seconds" in m.source or m.source.endswith("_s"):
            assert "seconds" in m.name, m.name


def test_the_docs_table_is_generated_from_the_list() -> None:
    assert markdown_table() in DOCS.read_text(), "regenerate docs/metrics.md (see its header)"


def _scrape() -> str:
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text: str = answer.read().decode()
    return text


def test_a_rank_exports_every_metric_with_its_type(ray_local: None) -> None:
    store = store_name()
    config = actors.DeploymentConfig(
        name="metrics", model=MODEL, cache=cache_config(store), host_budget_bytes=16 << 20
    )
    deployment = actors.Deployment.launch(config)
    try:
        tokens = prompt(90, 40)
        deployment.generate([GenerateRequest("m1", tokens, 4)])
        deployment.generate([GenerateRequest("m2", [*tokens, 1, 2, 3], 4)])
        wanted = [m for m in METRICS if m.source not in ("prefetch_s", "load_s")]

        def counted(text: str, series: str) -> float:
            found = re.search(series + r'\{[^}]*deployment="metrics"[^}]*\} (\S+)', text)
            return float(found[1]) if found else 0.0

        def exported() -> bool:
            text = _scrape()
            typed = all(f"# TYPE ray_{m.name} {m.kind}" in text for m in wanted)
            return typed and counted(text, "ray_hicache_requests_total") >= 2

        wait_until(exported, timeout_s=60, what="every metric, and both requests counted")
        text = _scrape()
        for m in wanted:
            assert f"# HELP ray_{m.name} {m.help}" in text, m.name
        assert counted(text, "ray_hicache_time_to_first_token_seconds_count") == 2
        ranks = deployment.stats().ranks
        assert [(r.device, r.model_backend) for r in ranks] == [("cpu", "gloo")]
    finally:
        deployment.shutdown()
        actors.drop_store(store)
