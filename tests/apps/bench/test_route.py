"""``bench route --quick``: two replicas behind each router, in the base scenario and with
one replica restarted mid-run, every figure written, no request failed (which router wins
is for the full benchmark to say, not a smoke test)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from apps.cli import main
from apps.report import Report


def test_bench_route_quick_writes_every_figure(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "route.json"
    main(["bench", "route", "--quick", "--json", str(out)])  # exit 1 when a target is missed
    report = msgspec.json.decode(out.read_bytes(), type=Report)
    by_name = {f.name: f for f in report.figures}
    assert report.command == "bench route" and report.config["replicas"] == [2]
    for router in ("cache", "prefix", "pow2"):
        assert by_name[f"route.r2.{router}.requests_per_s"].value > 0
        assert by_name[f"route.r2.{router}.ttft_p50_ms"].value > 0
        assert by_name[f"route.r2.{router}.failed"].value == 0
    assert by_name["route.failed_requests"].value == 0
    assert by_name["route.cache_vs_pow2.hit_tokens"].target == 1.5
    assert by_name["route.cache_vs_prefix.hit_tokens"].target == 1.1
    assert by_name["route.cache_vs_pow2.ttft_p50"].target == 0.7
    assert by_name["route.r2.cache.hit_tokens"].value > 0  # later turns found their history
    cost = by_name["route.router_cost_ms.p99"]  # one decision of the cache router
    assert cost.target == 2.0 and cost.value >= by_name["route.router_cost_ms.p50"].value > 0
    for router in ("cache", "prefix", "pow2"):  # a replica killed between rounds: no turn cut
        assert by_name[f"route.r2.restart.{router}.failed"].value == 0
        assert by_name[f"route.r2.restart.{router}.requests_per_s"].value > 0
        assert 0 <= by_name[f"route.r2.{router}.misrouted_share"].value <= 1
    assert by_name["route.restart.cache_vs_pow2.hit_tokens"].target is None  # per scenario
    for router in ("cache", "prefix", "pow2"):  # the tiers add up to the cached tokens
        tiers = sum(by_name[f"route.r2.{router}.hit_tokens.{t}"].value for t in ("l1", "l2", "l3"))
        assert tiers == by_name[f"route.r2.{router}.hit_tokens"].value
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "route.png").exists()


def test_bench_route_quick_runs_the_blind_spot_scenarios(tmp_path: Path, ray_local: None) -> None:
    """A hot shared prompt, bursts of siblings and a replica re-formed in place, over a ray
    L3, behind the cache router: every turn answered, every figure written."""
    out = tmp_path / "route.json"
    scenarios = "hot,burst,reform"
    main(
        [
            "bench",
            "route",
            "--quick",
            "--scenarios",
            scenarios,
            "--routers",
            "cache",
            "--json",
            str(out),
        ]
    )
    by_name = {f.name: f for f in msgspec.json.decode(out.read_bytes(), type=Report).figures}
    for scenario in scenarios.split(","):
        assert by_name[f"route.r2.{scenario}.cache.failed"].value == 0
        assert by_name[f"route.r2.{scenario}.cache.ttft_p90_ms"].value > 0
        assert 0.5 <= by_name[f"route.r2.{scenario}.cache.busiest_share"].value <= 1
