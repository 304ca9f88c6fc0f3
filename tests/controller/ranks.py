"""Rank processes for the multi-process tests: each rank sees its own storage.

Every scenario writes one prompt through all ranks (TP ranks of one deployment, each
backing up its own head shard into its own store), then a fresh deployment over the same
stores reads it back while one rank's store misbehaves. Each rank reports the cached
length it was handed (after checking the KV of every cached page) to the parent.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
import zlib
from typing import Any

import torch

from hicache_ray.base.storage_config import Fault
from hicache_ray.cache.controller import (
    ConsensusError,
    GlooConsensus,
    start_rendezvous,
)
from hicache_ray.keys import page_hashes, plan_shard
from hicache_ray.storage import MemoryObjects
from tests.conftest import make_kv
from tests.controller.driven import Driven, Stepped
from tests.controller.helpers import (
    PAGE,
    controller_config,
    drain,
    make_controller,
    prompt,
    run_request,
)

GLOO_TIMEOUT_S = 300.0  # far above every test's deadline: a hang shows up as the deadline

SCENARIOS: dict[str, dict[str, Any]] = {
    "all_hit": {},
    "missing": {"delete_from": 6},
    "read_fail": {"read_faults": (Fault(op="read", kind="fail", skip=3),)},
    "corrupt": {"read_faults": (Fault(op="read", kind="corrupt", skip=4, limit=1),)},
    "write_fail": {"write_faults": (Fault(op="write", kind="fail", skip=5),)},
    "slow_timeout": {
        "read_faults": (Fault(op="read", kind="delay", delay_s=0.1),),
        "policy": "timeout",
        "settle": False,
    },
    "slow_wait": {"read_faults": (Fault(op="read", kind="delay", delay_s=0.01),)},
}
EXPECTED = {
    "all_hit": 16,
    "missing": 6,
    "read_fail": 3,
    "corrupt": 4,
    "write_fail": 5,
    "slow_wait": 16,
}  # slow_timeout: whatever finished, but the same on every rank
ODD_RANK = 1  # the rank whose store misbehaves


def connect(rank: int, world: int, ports: Any) -> GlooConsensus:
    if rank == 0:
        rendezvous = start_rendezvous(world, timeout_s=GLOO_TIMEOUT_S)
        for _ in range(world - 1):
            ports.put(rendezvous.port)
        return GlooConsensus(
            0,
            world,
            "127.0.0.1",
            rendezvous.port,
            timeout_s=GLOO_TIMEOUT_S,
            rendezvous=rendezvous,
        )
    port = ports.get(timeout=60)
    return GlooConsensus(rank, world, "127.0.0.1", port, timeout_s=GLOO_TIMEOUT_S)


def record_agreements(ctl: Driven, history: list[Any]) -> None:
    """Log what every step agreed (step, arrivals, runnable, each request's agreed facts)."""
    step = ctl.step

    def logged(arrivals: Any = (), aborts: Any = ()) -> Stepped:
        result = step(arrivals, aborts)
        agreed = [(rid, r.agreed) for rid, r in ctl.known.items()]
        history.append((result.step, [a.rid for a in result.arrivals], result.runnable, agreed))
        return result

    ctl.step = logged  # type: ignore[method-assign]


def run_scenario(
    rank: int, world: int, consensus: GlooConsensus, name: str
) -> tuple[int, list[Any]]:
    spec = SCENARIOS[name]
    odd = rank == ODD_RANK
    kv = make_kv(page_size=PAGE, num_kv_heads=4, tp_rank=rank, tp_size=world)
    # One object per page and rank (nothing declared: this TP size's own grid), so the
    # fault counts above are counts of pages.
    config = controller_config(prefetch_policy=spec.get("policy", "wait_complete"))
    objects = MemoryObjects()
    tokens = prompt(zlib.crc32(name.encode()) % 1000, 16 * PAGE)
    writer = make_controller(
        config,
        kv,
        objects,
        faults=spec.get("write_faults", ()) if odd else (),
        consensus=consensus,
    )
    history: list[Any] = []
    record_agreements(writer, history)
    run_request(writer, "w", tokens)
    drain(writer)
    writer.check_integrity()
    writer.close()
    if odd and "delete_from" in spec:
        plan = plan_shard(kv, config)
        for h in page_hashes(tokens, PAGE)[spec["delete_from"] :]:
            for key in plan.keys(h):
                objects.remove_many([key])
    reader = make_controller(
        config,
        kv,
        objects,
        faults=spec.get("read_faults", ()) if odd else (),
        consensus=consensus,
    )
    record_agreements(reader, history)
    cached, _ = run_request(reader, "r", [*tokens, 1, 2, 3], settle=spec.get("settle", True))
    drain(reader)
    reader.check_integrity()
    reader.close()
    return cached, history


def rank_main(rank: int, world: int, ports: Any, out: Any, scenarios: list[str]) -> None:
    torch.set_num_threads(1)
    consensus = connect(rank, world, ports)
    for name in scenarios:
        try:
            out.put((name, rank, run_scenario(rank, world, consensus, name)))
        except Exception:
            out.put((name, rank, traceback.format_exc()))
    consensus.close()


def dying_rank_main(rank: int, world: int, ports: Any, out: Any, die_at: int) -> None:
    """Step with the others until step ``die_at``, where rank ``world - 1`` exits abruptly."""
    torch.set_num_threads(1)
    consensus = connect(rank, world, ports)
    kv = make_kv(page_size=PAGE, num_kv_heads=world, tp_rank=rank, tp_size=world)
    config = controller_config()
    ctl = make_controller(config, kv, MemoryObjects(), consensus=consensus)
    start = 0.0
    try:
        for step in range(1, 1_000_000):
            if step == die_at:
                if rank == world - 1:
                    os._exit(3)  # mid-step: the others are already in the collective
                start = time.monotonic()
            ctl.step()
    except ConsensusError as exc:
        out.put((rank, time.monotonic() - start, str(exc)))
    except queue.Empty:  # pragma: no cover - reported by the deadline instead
        pass


def stalled_rank_main(
    rank: int, world: int, ports: Any, out: Any, release: Any, stall_at: int, timeout_s: float
) -> None:
    """Rank 1 stops stepping at ``stall_at`` until ``release`` is set; the others must time
    out with the step and the group named."""
    torch.set_num_threads(1)
    if rank == 0:
        rendezvous = start_rendezvous(world, timeout_s=60)
        for _ in range(world - 1):
            ports.put(rendezvous.port)
        consensus = GlooConsensus(
            0, world, "127.0.0.1", rendezvous.port, timeout_s=timeout_s, rendezvous=rendezvous
        )
    else:
        consensus = GlooConsensus(
            rank, world, "127.0.0.1", ports.get(timeout=60), timeout_s=timeout_s
        )
    kv = make_kv(page_size=PAGE, num_kv_heads=world, tp_rank=rank, tp_size=world)
    ctl = make_controller(controller_config(), kv, MemoryObjects(), consensus=consensus)
    start = 0.0
    try:
        for step in range(1, 1_000_000):
            if step == stall_at:
                if rank == 1:
                    release.wait(120)  # stalled (a hung forward pass, a paused process)
                start = time.monotonic()
            ctl.step()
    except ConsensusError as exc:
        out.put((rank, time.monotonic() - start, str(exc)))
