"""``bench pd`` end to end on a small model: every figure written, exact answers, the
next turn's history found by the prefill side."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from apps.cli import main
from apps.report import Report


def test_bench_pd_writes_every_figure_and_answers_exactly(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "pd.json"
    argv = ["bench", "pd", "--model", "tiny4", "--prompt-tokens", "1024", "--requests", "1"]
    # a model this small computes 1,024 tokens faster than the handoff: targets may miss
    assert main([*argv, "--json", str(out)]) in (0, 1)
    report = msgspec.json.decode(out.read_bytes(), type=Report)
    by_name = {f.name: f for f in report.figures}
    assert set(by_name) == {
        "pd.handoff_share",
        "pd.ttft_ms.split",
        "pd.ttft_ms.colocated",
        "pd.itl_p99_vs_colocated",
        "pd.wrong_outputs",
        "pd.next_turn_hit_share",
        "pd.pinned",
    }
    assert report.command == "bench pd" and report.config["prompt_tokens"] == 1024
    assert by_name["pd.wrong_outputs"].value == 0
    assert by_name["pd.next_turn_hit_share"].value == 1.0
    assert 0 < by_name["pd.handoff_share"].value < 1
    assert by_name["pd.pinned"].value in (0.0, 1.0)
    ceiling = by_name["pd.itl_p99_vs_colocated"].ceiling
    assert ceiling is not None and ceiling > 0


def test_bench_pd_faults_answers_every_scenario_exactly(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "pd-faults.json"
    assert main(["bench", "pd", "--faults", "--json", str(out)]) == 0
    report = msgspec.json.decode(out.read_bytes(), type=Report)
    by_name = {f.name: f.value for f in report.figures}
    for name in ("wrong", "hung", "failed", "leaked_pages"):
        assert by_name[f"pd.faults.{name}"] == 0, name
    assert by_name["pd.faults.scenarios"] == len(report.rows) == 8
    # the runs that split were answered from what L3 held, or recomputed; none hung
    assert all(row["seconds"] < 120 for row in report.rows)


def test_bench_pd_sweep_measures_both_ways_at_every_length(tmp_path: Path, ray_local: None) -> None:
    from apps.bench.pd_inflight import BURST_PROMPTS, BURST_TOKENS, INFLIGHT_CAPS
    from apps.bench.pd_sweep import SWEEP_SHARES, SWEEP_TOKENS

    out = tmp_path / "pd-sweep.json"
    argv = ["bench", "pd", "--sweep", "--model", "tiny4", "--prompt-tokens", "1024"]
    # a model this small computes faster than the handoff: no length may pay
    assert main([*argv, "--json", str(out)]) in (0, 1)
    report = msgspec.json.decode(out.read_bytes(), type=Report)
    by_name = {f.name: f.value for f in report.figures}
    assert report.config["sweep"] is True
    for n in SWEEP_TOKENS:  # every request was split or not as asked (else the run fails)
        assert by_name[f"pd.sweep.{n}.ttft_apart_ms"] > 0
        assert by_name[f"pd.sweep.{n}.ttft_here_ms"] > 0
        assert 0 < by_name[f"pd.sweep.{n}.handoff_share"] < 1
    for share in SWEEP_SHARES:  # the head computed on decode first, then both ways
        assert by_name[f"pd.sweep.share_{share}.ttft_apart_ms"] > 0
        assert by_name[f"pd.sweep.share_{share}.ttft_here_ms"] > 0
        assert by_name[f"pd.sweep.share_{share}.extra_share"] < 1
    least = by_name["pd.sweep.min_uncached_tokens"]
    assert least in {*SWEEP_TOKENS, 2 * max(SWEEP_TOKENS)}
    assert by_name["pd.sweep.min_uncached_share"] in {*SWEEP_SHARES, 1.0}
    # the burst: nothing split with the split off; under a cap of k prompts' tokens, the
    # first k (every decision is taken before any prompt is handed off)
    assert by_name["pd.sweep.inflight.off.split_share"] == 0
    for cap in INFLIGHT_CAPS:
        want = min(BURST_PROMPTS, cap // BURST_TOKENS) / BURST_PROMPTS
        assert by_name[f"pd.sweep.inflight.{cap}.split_share"] == want, cap
    for run in ("off", *map(str, INFLIGHT_CAPS)):
        assert by_name[f"pd.sweep.inflight.{run}.ttft_p90_ms"] > 0
        assert by_name[f"pd.sweep.inflight.{run}.itl_p99_ms"] > 0
    assert by_name["pd.sweep.inflight.min_cap"] in INFLIGHT_CAPS
    pace = by_name["pd.sweep.inflight.pace_per_1k_s"]
    assert pace > 0
    assert by_name["pd.sweep.inflight.drain_s"] == pytest.approx(32768 * pace / 1024)
