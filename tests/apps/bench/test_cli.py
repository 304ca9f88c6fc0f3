from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from apps.cli import main
from apps.report import Report, figure


def test_figure_verdicts() -> None:
    f = figure("x", 8.0, "GB/s", ceiling=10.0, target=0.8)
    assert f.ratio == 0.8 and f.meets
    assert not figure("y", 5.0, "ms", target=3, better="lower").meets
    assert figure("z", 1.0, "s").meets is None


def test_bench_micro_quick_writes_schema(tmp_path: Path) -> None:
    out = tmp_path / "micro.json"
    assert main(["bench", "micro", "--quick", "--device", "cpu", "--json", str(out)]) == 0
    report = msgspec.json.decode(out.read_bytes(), type=Report)
    assert report.schema_version == 1 and report.command == "bench micro"
    names = {f.name for f in report.figures}
    for layout in ("layer_first", "page_first", "page_first_direct"):
        assert f"transfer.load.{layout}.gbps" in names
        assert f"transfer.write.{layout}.gbps" in names
    assert {"tree.insert_per_s", "tree.match_per_s", "tree.evict_all_s"} <= names
    assert {"tree.vs_sglang.insert", "tree.vs_sglang.match"} <= names  # SGLang in make's venv
    assert {"consensus.step_us.world2", "consensus.step_us.world4", "fetch.l3_to_l1.gbps"} <= names
    for f in report.figures:
        if f.name.startswith("transfer."):
            assert f.ceiling and f.ceiling > 0 and f.ratio is not None and f.value > 0


def _figures(path: Path) -> dict[str, object]:
    report = msgspec.json.decode(path.read_bytes(), type=Report)
    return {f.name: f for f in report.figures}


def test_demo_quick_continues_on_tp4_from_l3(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "demo.json"
    assert main(["demo", "--quick", "--json", str(out)]) == 0
    by_name: dict[str, Any] = _figures(out)
    assert by_name["multiturn.exactness.wrong_outputs"].value == 0
    assert by_name["multiturn.tp2.hit_tokens.l1"].value > 0
    assert by_name["multiturn.tp4.hit_tokens.l3"].value > 0  # empty pools, history in L3
    for series in ("tp2", "tp4"):
        assert by_name[f"multiturn.{series}.ttft_p50_ms"].value > 0
        assert by_name[f"multiturn.{series}.oracle_ratio"].meets
    assert (tmp_path / "demo.png").stat().st_size > 1000


def test_bench_multiturn_quick_every_mode(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "mt.json"
    assert main(["bench", "multiturn", "--quick", "--json", str(out)]) == 0
    by_name: dict[str, Any] = _figures(out)
    for mode in ("none", "l1", "l1_l2", "l1_l2_l3"):
        assert by_name[f"multiturn.{mode}.ttft_p50_ms"].value > 0
        for tier in ("l1", "l2", "l3"):
            assert f"multiturn.{mode}.hit_tokens.{tier}" in by_name
    assert by_name["multiturn.none.hit_tokens.l1"].value == 0
    assert by_name["multiturn.l1_l2.oracle_ratio"].meets
    assert by_name["multiturn.infinite_cache.hit_tokens"].value > 0
    assert by_name["multiturn.exactness.wrong_outputs"].value == 0
    assert (tmp_path / "mt.png").exists()


def test_bench_storage_quick_writes_every_figure(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "storage.json"
    root = str(tmp_path / "l3")
    backends = [
        "--backend",
        "memory",
        "--backend",
        "file",
        "--backend",
        "ray",
        "--backend",
        "sglang",
        "--backend",
        "vllm",
    ]
    assert main(["bench", "storage", "--quick", *backends, "--root", root, "--json", str(out)]) == 0
    report = msgspec.json.decode(out.read_bytes(), type=Report)
    by_name = {f.name: f for f in report.figures}
    assert by_name["hash.100k_tokens_ms"].value > 0
    for backend in ("memory", "file", "ray"):
        for op in ("put", "get"):
            f = by_name[f"storage.{backend}.{op}.gbps"]
            assert f.value > 0 and f.ceiling and f.ratio is not None
        assert by_name[f"storage.{backend}.exists128_us"].value > 0
    for op in ("get_v1", "set_v1", "get", "set"):
        f = by_name[f"storage.sglang.{op}.gbps"]
        assert f.value > 0 and f.ceiling and f.ratio is not None
        assert f.target == (0.7 if op.endswith("_v1") else None)
    assert report.config["sglang"]["layout"] == "page_first"
    for op in ("load", "save"):  # a save timed until the store holds it, and as before
        f = by_name[f"storage.vllm.{op}.gbps"]
        assert f.value > 0 and f.ceiling and f.ratio is not None
    assert (
        by_name["storage.vllm.save_foreground.gbps"].value
        >= by_name["storage.vllm.save.gbps"].value
    )
    assert not list((tmp_path / "l3").rglob("*-*_*"))  # the bench removed its pages


def test_bench_runtime_quick_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "runtime.json"
    profile = tmp_path / "rank.pstats"
    argv = ["bench", "runtime", "--quick", "--json", str(out), "--profile", str(profile)]
    assert main(argv) == 0
    report = msgspec.json.decode(out.read_bytes(), type=Report)
    by_name = {f.name: f for f in report.figures}
    for length in (128, 256):
        for tier in ("l1", "l2", "l3", "miss"):
            assert by_name[f"runtime.ttft_ms.{tier}.{length}"].value > 0
    assert by_name["runtime.l2_hit.overhead_vs_floor"].target == 1.5
    assert by_name["runtime.pure_miss.overhead_pct"].target == 3
    assert by_name["runtime.events.overhead_pct"].target == 3
    assert by_name["runtime.hit_rest_ms.in_process"].target == 10.0
    assert by_name["runtime.l3_prefetch_vs_store"].target == 2.0
    assert by_name["runtime.l1.ttft_split.forward_s_p50_ms"].value > 0
    import pstats

    names = {func for _, _, func in pstats.Stats(str(profile)).stats}
    assert "_forward" in names  # the rank's steps (RankRuntime._forward) were profiled


def test_bench_faults_every_scenario_survives(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "faults.json"
    assert main(["bench", "faults", "--json", str(out)]) == 0
    by_name: dict[str, Any] = _figures(out)
    from apps.bench.options import FAULT_SCENARIOS as SCENARIOS

    for scenario in SCENARIOS:
        assert by_name[f"faults.{scenario}.wrong_outputs"].value == 0
        assert by_name[f"faults.{scenario}.failed_requests"].value == 0
        assert by_name[f"faults.{scenario}.recovery_s"].value < 60
    for scenario in ("rank_killed_admit", "rank_killed_prefill", "rank_killed_decode"):
        assert by_name[f"faults.{scenario}.recovery_s"].value > 0  # it re-formed
        # the new ranks' pools are empty: the retried turn found its history in L3
        assert by_name[f"faults.{scenario}.l3_hit_tokens_after"].value > 0


def test_bench_soak_short_form_holds(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "soak.json"
    assert (
        main(["bench", "soak", "--duration", "12", "--fault-every", "5", "--json", str(out)]) == 0
    )
    by_name: dict[str, Any] = _figures(out)
    assert by_name["soak.requests"].value > 0 and by_name["soak.faults_injected"].value >= 1
    assert by_name["soak.faults_survived"].value >= 1
    for name in ("failed_requests", "wrong_outputs", "leaked_pages", "object_store_leaked"):
        assert by_name[f"soak.{name}"].value == 0, name


def test_bench_serve_quick_writes_every_figure(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--quick", "--clients", "3", "--http", "--json", str(out)]
    assert main(argv) == 0
    report = msgspec.json.decode(out.read_bytes(), type=Report)
    by_name = {f.name: f for f in report.figures}
    assert report.config["experiment"]["clients"] == 3  # an explicit flag beats --quick
    assert report.config["experiment"]["model"] == "tiny4"
    for mode in ("none", "l1_l2", "l1_l2_l3"):
        assert by_name[f"serve.{mode}.requests_per_s"].value > 0
        assert by_name[f"serve.{mode}.ttft_p50_ms"].value > 0
        assert by_name[f"serve.{mode}.failed_requests"].value == 0
    assert by_name["serve.cache_speedup"].target == 3.0
    assert by_name["serve.cache_speedup.cold"].value > 0  # no untimed warm-up
    assert by_name["serve.batching_speedup"].value > 0
    assert by_name["serve.overload.failed_requests"].value == 0
    for mode in ("none", "l1_l2_l3"):  # the same clients through the OpenAI endpoint
        assert by_name[f"serve.http.{mode}.requests_per_s"].value > 0
        assert by_name[f"serve.http.{mode}.ttft_p50_ms"].value > 0
    assert by_name["serve.http.failed_requests"].value == 0
    speedup = by_name["serve.http.cache_speedup.vs_api"]
    assert speedup.ceiling == by_name["serve.cache_speedup"].value and speedup.ratio is not None
    assert by_name["serve.http.batching_speedup"].value > 0
    assert (tmp_path / "serve.png").exists()


def test_runtime_on_deployments_times_l1_hits_at_each_tp(ray_local: None) -> None:
    from apps.bench.runtime_tp import deployment_figures
    from hicache_ray.engine.model import preset

    found = deployment_figures(preset("tiny4"), (2,), 32, 8, 4, hits=2, log=lambda _: None)
    by_name = {f.name: f for f in found}
    assert by_name["runtime.hit_rest_ms.tp2"].target == 10.0
    assert by_name["runtime.hit_rest_ms.tp2"].value >= 0
    client = by_name["runtime.l1_client_ttft_ms.tp2"]
    assert client.value > 0 and client.ceiling is not None and client.ceiling > 0
    assert by_name["runtime.l1_tp2.ttft_split.forward_s_p50_ms"].value > 0
    assert by_name["runtime.hit_rest_rank_ms.tp2"].value >= 0  # the old clock, beside


def test_an_l3_hit_on_a_fresh_deployment_beside_bare_reads(ray_local: None) -> None:
    from apps.bench.runtime_l3 import l3_hit_figures
    from hicache_ray.engine.model import preset

    found = l3_hit_figures(preset("tiny4"), (2,), 320, repeats=1, log=lambda _: None)
    by_name = {f.name: f for f in found}
    wait = by_name["runtime.l3_hit.wait_vs_store.tp2"]
    assert wait.target == 1.5 and wait.ceiling is not None and wait.ceiling > 0
    assert by_name["runtime.l3_hit.ttft_vs_l1.tp2"].target == 60.0
    assert by_name["runtime.l3_hit.ttft_ms.tp2"].value > 0
    assert wait.value > 0  # admitted to started: query, agreement and reads
    # a small prefix's reads may end inside the admitting step, which then counts them
    assert by_name["runtime.l3_hit.tp2.ttft_split.prefetch_s_p50_ms"].value >= 0
    # a store slower than compute (an injected delay), with the recompute guard and without
    guarded = by_name["runtime.slow_store.hit_vs_recompute"]
    assert guarded.target == 1.1 and guarded.ceiling is not None and guarded.ceiling > 0
    assert by_name["runtime.slow_store.hit_vs_recompute.unguarded"].value > 0
    assert by_name["runtime.slow_store.first_hit_vs_recompute"].value > 0
