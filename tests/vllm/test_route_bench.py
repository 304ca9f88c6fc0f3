"""``bench route --engine vllm``: conversations through two vLLM replicas behind the cache
router and behind Ray's prefix router; no turn fails, every answer names the replica that
served it, the later turns are served from cache, the answers equal a plain vLLM engine's,
the figures are ``route.vllm.*``; ``reform`` (ranks re-formed in place: none in vLLM) is
skipped and a preset model refused before anything starts."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from apps.bench.options import RouteOptions
from apps.bench.route_bench import run_route_bench
from apps.bench.vllm_apps import vllm_scratch_env
from hicache_ray.base.errors import ConfigError

pytest.importorskip("ray.serve.llm")

# What vLLM leaves in the temporary folder when Serve kills its engine: ZMQ sockets named
# by a UUID, torch.distributed rendezvous files.
_VLLM_LEFTOVER = re.compile(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}|vllm_dist_[0-9a-f]+")


def _vllm_leftovers() -> set[str]:
    """vLLM's files in the system's temporary folder (where the run's scratch folder is)."""
    system = Path(vllm_scratch_env()["TMPDIR"]).parent
    return {n for n in os.listdir(system) if _VLLM_LEFTOVER.fullmatch(n)}


def test_conversations_through_vllm_replicas(checkpoint: Path, tmp_path: Path) -> None:
    from tests.helpers import ensure_local_ray

    ensure_local_ray()
    opts = RouteOptions(
        engine="vllm",
        model=str(checkpoint),
        routers=("cache", "prefix"),
        scenarios=("base", "reform"),
        replicas=(2,),
        conversations=4,
        clients=2,
        rounds=2,
        system_len=96,
        user_len=32,
        answer_len=8,
        device_tokens=1024,
        check=3,
        turn_log=str(tmp_path / "turns.jsonl"),
    )
    lines: list[str] = []
    before = _vllm_leftovers()
    got = {f.name: f for f in run_route_bench(opts, lines.append)}
    assert _vllm_leftovers() <= before  # the replicas' and the recompute's went with the run
    assert any("reform skipped" in line for line in lines)
    assert not any(".reform." in name for name in got)
    assert got["route.vllm.failed_requests"].value == 0
    for router in ("cache", "prefix"):
        # the second round's prompts hold the first round's: cached on their replica
        assert got[f"route.vllm.r2.{router}.hit_tokens"].value > 0
    turns = [json.loads(line) for line in (tmp_path / "turns.jsonl").read_text().splitlines()]
    assert len(turns) == 2 * 4 * 2  # routers x conversations x rounds
    replicas = {turn["replica"] for turn in turns}  # each answer names its replica
    assert "" not in replicas and 1 <= len(replicas) <= 4  # two per app, two apps
    assert got["route.vllm.wrong_outputs"].value == 0
    assert got["route.vllm.checked_outputs"].value == 6  # 3 answers x 2 routers
    assert got["route.vllm.cache_vs_prefix.hit_tokens"].value > 0
    assert got["route.vllm.base.cache_vs_prefix.hit_tokens"].target == 0.97
    assert not any(name.startswith("route.router_cost") for name in got)


def test_vllm_routes_a_checkpoint_not_a_preset() -> None:
    with pytest.raises(ConfigError, match="checkpoint directory"):
        run_route_bench(RouteOptions(engine="vllm", model="tiny4"), print)
