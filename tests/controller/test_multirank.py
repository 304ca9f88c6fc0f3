"""2 and 4 ranks (spawned processes, gloo) that see different storage must agree and never hang."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.controller import ranks

DEADLINE_S = 150.0  # far below the gloo timeout (ranks.GLOO_TIMEOUT_S)


def spawn(world: int, target: Callable[..., None], *args: Any) -> tuple[list[Any], Any, Any]:
    """Start ``world`` rank processes; keep the returned queues alive while they run."""
    ctx = mp.get_context("spawn")
    ports, out = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(r, world, ports, out, *args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs, out, ports


def collect(procs: list[Any], out: Any, ports: Any, count: int) -> list[Any]:
    deadline = time.monotonic() + DEADLINE_S
    results = []
    try:
        while len(results) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"ranks hung: {len(results)} of {count} results before the deadline")
            try:
                results.append(out.get(timeout=min(remaining, 5.0)))
            except Exception:
                if not any(p.is_alive() for p in procs) and out.empty():
                    pytest.fail(f"every rank exited with {len(results)} of {count} results")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_with_different_storage_agree_and_read_correct_kv(world: int) -> None:
    names = list(ranks.SCENARIOS)
    procs, out, ports = spawn(world, ranks.rank_main, names)
    results = collect(procs, out, ports, world * len(names))
    by_name: dict[str, dict[int, Any]] = {}
    for name, rank, value in results:
        by_name.setdefault(name, {})[rank] = value
    for name in names:
        outcomes = by_name[name]
        errors = {r: v for r, v in outcomes.items() if not isinstance(v, tuple)}
        assert not errors, f"{name}: {errors}"
        values = {r: cached for r, (cached, _) in outcomes.items()}
        assert len(set(values.values())) == 1, f"{name}: ranks disagree: {values}"
        histories = [history for _, history in outcomes.values()]
        assert all(h == histories[0] for h in histories), f"{name}: a step agreed differently"
        cached = values[0]
        if name in ranks.EXPECTED:
            assert cached == ranks.EXPECTED[name], f"{name}: {values}"
        else:
            assert 0 <= cached < 16, f"{name}: the deadline should cut the slow reads: {values}"


def test_a_dead_rank_fails_the_others_fast_with_a_clear_error() -> None:
    world = 3
    procs, out, ports = spawn(world, ranks.dying_rank_main, 20)
    results = collect(procs, out, ports, world - 1)
    assert sorted(r for r, _, _ in results) == [0, 1]
    for _, elapsed, message in results:
        assert elapsed < 30, message
        assert "step 20" in message and "group 'hicache'" in message


def test_a_stalled_rank_times_the_others_out_with_the_step_named() -> None:
    ctx = mp.get_context("spawn")
    release = ctx.Event()
    procs, out, ports = spawn(2, ranks.stalled_rank_main, release, 10, 3.0)
    try:
        first = collect_one(procs, out)
    finally:
        release.set()
    results = [first, *collect(procs, out, ports, 1)]
    by_rank = {rank: (elapsed, message) for rank, elapsed, message in results}
    elapsed, message = by_rank[0]
    assert 2.0 < elapsed < 30, message
    assert "step 10" in message and "timeout 3.0s" in message and "'hicache'" in message
    assert "re-form the deployment" in message


def collect_one(procs: list[Any], out: Any) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1.0)
        except Exception:
            if not any(p.is_alive() for p in procs):
                pytest.fail("every rank exited without a result")
    pytest.fail("no rank reported the stall before the deadline")
