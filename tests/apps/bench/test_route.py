"""``bench route --quick``: two replicas behind each router in the base scenario, and
behind the cache router in every other (one replica restarted mid-run among them), every
figure written, no request failed (which router wins is for the full benchmark to say, not
a smoke test)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
import pytest

from apps.bench.options import RouteOptions, _replica_counts
from apps.bench.route_bench import _comparisons, scenarios
from apps.bench.route_clients import RouteRun, Scenario
from apps.bench.route_trace import trace_l1
from apps.bench.trace_data import DEFAULT_TRACE, load_trace, scale
from apps.cli import main
from apps.report import Report


def test_bench_route_quick_writes_every_figure(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "route.json"
    # exit 1 when a target is missed; the other scenarios: the test below
    main(["bench", "route", "--quick", "--scenarios", "base", "--json", str(out)])
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
    assert by_name["route.r2.prefix.tree_chars"].value > 0  # Ray's router's tree, read back
    assert "route.r2.cache.tree_chars" not in by_name
    cost = by_name["route.router_cost_ms.p99"]  # one decision of the cache router
    assert cost.target == 2.0 and cost.value >= by_name["route.router_cost_ms.p50"].value > 0
    for router in ("cache", "prefix", "pow2"):
        assert 0 <= by_name[f"route.r2.{router}.misrouted_share"].value <= 1
    assert by_name["route.base.cache_vs_pow2.hit_tokens"].target is None  # per scenario
    for router in ("cache", "prefix", "pow2"):  # the tiers add up to the cached tokens
        tiers = sum(by_name[f"route.r2.{router}.hit_tokens.{t}"].value for t in ("l1", "l2", "l3"))
        assert tiers == by_name[f"route.r2.{router}.hit_tokens"].value
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "route.png").exists()


def test_bench_route_quick_runs_the_blind_spot_scenarios(tmp_path: Path, ray_local: None) -> None:
    """A replica restarted between rounds, a hot shared prompt, bursts of siblings, a
    replica re-formed in place and the trace, over a ray L3, behind the cache router: every
    turn answered (none cut by the restart), every figure written, every turn in the turn
    log. ``tiers`` is left out (an app start of 40 s here): it runs base's conversations
    with hot's client count over the ray L3, no code of its own (its sizes:
    ``test_the_tiers_scenario_is_base_over_the_l3_with_hots_clients``)."""
    out, turns = tmp_path / "route.json", tmp_path / "turns.jsonl"
    scenarios = "restart,hot,burst,reform,trace"
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
            "--turn-log",
            str(turns),
        ]
    )
    by_name = {f.name: f for f in msgspec.json.decode(out.read_bytes(), type=Report).figures}
    logged = [json.loads(line) for line in turns.read_text().splitlines()]
    for scenario in scenarios.split(","):
        mine = [t for t in logged if t["scenario"] == scenario]
        rate = by_name[f"route.r2.{scenario}.cache.requests_per_s"].value
        assert mine and rate > 0 and {t["router"] for t in mine} == {"cache"}
        assert all(t["ttft_s"] > 0 and t["replica"] and t["replicas"] == 2 for t in mine)
        assert all(t["l1"] + t["l2"] + t["l3"] < t["prompt_tokens"] for t in mine)
        assert by_name[f"route.r2.{scenario}.cache.failed"].value == 0
        assert by_name[f"route.r2.{scenario}.cache.ttft_p90_ms"].value > 0
        assert 0.5 <= by_name[f"route.r2.{scenario}.cache.busiest_share"].value <= 1


def test_the_tiers_scenario_is_base_over_the_l3_with_hots_clients() -> None:
    every = ("base", "tiers", "hot")
    got = scenarios(RouteOptions(scenarios=every))
    assert got["tiers"] == Scenario("tiers", clients=got["hot"].clients, storage="ray")
    assert got["hot"].clients > 0 and got["base"].storage == "none"


def test_route_options_refuse_bad_replica_counts() -> None:
    assert _replica_counts("2, 3") == (2, 3)
    for bad in ("", "1", "2,x", "9"):
        with pytest.raises(argparse.ArgumentTypeError, match="replica counts"):
            _replica_counts(bad)


@pytest.mark.parametrize(
    "flags",
    [["--engine", "sglang"], ["--check", "-1"], ["--check", "many"]],
)
def test_bench_route_refuses_a_bad_engine_or_check_count(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "route", *flags])
    assert exit_.value.code == 2  # argparse: refused before anything starts
    assert flags[0] in capsys.readouterr().err


def test_the_trace_scenario_holds_two_of_its_longest_request() -> None:
    opts = RouteOptions.quick_options()
    requests = scale(load_trace(DEFAULT_TRACE, opts.trace_requests), opts.page_size, 2)
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    assert trace_l1(opts) % opts.page_size == 0 and 2 * longest <= trace_l1(opts)
    assert trace_l1(opts) < 2 * longest + opts.page_size
    assert "trace" not in scenarios(opts)  # not asked for: the trace is not read
    wide = RouteOptions(scenarios=("trace",), device_tokens=1 << 20)
    assert scenarios(wide)["trace"].device_tokens == 1 << 20  # never lowered


def test_comparisons_name_the_replica_count_past_the_first() -> None:
    def run(cached: int, ttft: float) -> RouteRun:
        return RouteRun(ttft_s=[ttft] * 4, cached_tokens=cached)

    runs = {("hot", "cache"): run(300, 1.0), ("hot", "pow2"): run(100, 2.0)}
    first = {f.name: f for f in _comparisons(runs, ["hot"], "route", True, False)}
    later = {f.name: f for f in _comparisons(runs, ["hot"], "route.r3", False, False)}
    assert first["route.cache_vs_pow2.hit_tokens"].value == 3.0
    assert first["route.cache_vs_pow2.hit_tokens"].target == 1.5
    assert first["route.hot.cache_vs_pow2.ttft_p90"].value == 0.5
    assert later["route.r3.cache_vs_pow2.hit_tokens"].target is None  # targets: first count
    assert later["route.r3.hot.cache_vs_pow2.ttft_p50"].value == 0.5
    assert "route.r3.failed_requests" in later


def test_vllm_comparisons_carry_their_own_targets() -> None:
    def run(cached: int, ttft: float) -> RouteRun:
        return RouteRun(ttft_s=[ttft] * 4, cached_tokens=cached)

    runs = {
        (name, router): run(cached, ttft)
        for name in ("base", "trace")
        for router, cached, ttft in (("cache", 300, 1.0), ("prefix", 290, 2.0), ("pow2", 100, 1.0))
    }
    got = {f.name: f for f in _comparisons(runs, ["base", "trace"], "route.vllm", True, True)}
    assert got["route.vllm.failed_requests"].target == 0
    assert got["route.vllm.cache_vs_pow2.hit_tokens"].target == 1.5
    assert got["route.vllm.cache_vs_prefix.hit_tokens"].target is None
    for name in ("base", "trace"):  # never below 0.97x the prefix router's, in any scenario
        assert got[f"route.vllm.{name}.cache_vs_prefix.hit_tokens"].target == 0.97
    assert got["route.vllm.trace.cache_vs_prefix.ttft_p90"].target == 0.8
    assert got["route.vllm.trace.cache_vs_prefix.ttft_p90"].value == 0.5
    assert got["route.vllm.base.cache_vs_prefix.ttft_p90"].target is None
    assert got["route.vllm.cache_vs_pow2.ttft_p50"].target is None  # this engine's own target
