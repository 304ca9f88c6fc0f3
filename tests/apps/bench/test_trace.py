"""``bench trace --quick``: 30 trace requests through the OpenAI app in every mode and in
the overload run, every figure written, no request failed, answers exact (which mode wins
is for the full benchmark to say, not a smoke test)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from apps.cli import main
from apps.report import Report

pytestmark = pytest.mark.slow


def test_bench_trace_quick_writes_every_figure(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "trace.json"
    main(["bench", "trace", "--quick", "--json", str(out)])  # exit 1 when a target is missed
    report = msgspec.json.decode(out.read_bytes(), type=Report)
    by_name = {f.name: f for f in report.figures}
    assert report.command == "bench trace" and report.config["limit"] == 30
    ideal = by_name["trace.ideal.hit_tokens"].value
    assert 0 < by_name["trace.lru_oracle.hit_tokens"].value <= ideal
    for run in ("trace", "trace.overload"):
        for mode in ("none", "l1_l2", "l1_l2_l3"):
            name = f"{run}.{mode}"
            assert by_name[f"{name}.failed_requests"].value == 0
            assert by_name[f"{name}.requests_per_s"].value > 0
            assert by_name[f"{name}.ttft_p50_ms"].value > 0
            tiers = sum(by_name[f"{name}.hit_tokens.{t}"].value for t in ("l1", "l2", "l3"))
            assert tiers == by_name[f"{name}.hit_tokens"].value <= ideal
            assert 0 <= by_name[f"{name}.slo_attainment"].value <= 1
        assert by_name[f"{run}.none.hit_tokens"].value == 0
        assert by_name[f"{run}.l1_l2_l3.hit_tokens"].value > 0
    assert by_name["trace.l1_l2_l3.hit_vs_ideal"].target == 0.95
    assert by_name["trace.overload.l1_l2_l3.hit_vs_ideal"].target == 0.85
    assert by_name["trace.cache_speedup.ttft_p90"].target == 2
    assert by_name["trace.wrong_outputs"].value == 0
    assert by_name["trace.checked_outputs"].value == 6  # 2 requests x 3 modes
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "trace.png").exists()
