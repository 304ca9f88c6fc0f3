"""``bench pd --faults``: a prefill/decode pair under faults, one scenario at a time.

One pair (prefill TP=2, decode TP=1, the ``tiny4`` model, the ray store; each of the
prefill side's L3 write calls waits ``WRITE_DELAY_S``, so a prompt's backup lasts about a
second, a window a fault can land in) serves one request per scenario, a 256-token prompt it splits:

    prefill_killed_mid_prefill    a prefill rank crashes while computing the prompt
    prefill_killed_before_backup  a prefill rank is killed while the prompt's backup runs
    prefill_killed_after_backup   a prefill rank is killed after a turn was handed off;
                                  the next turn is split again
    store_shard_killed            the store's shards are killed while the backup runs
    decode_killed_while_waiting   the decode rank is killed while the handoff waits
    cancel_while_prefilling       the caller cancels while the prefill side computes
    cancel_while_handing_off      ... while the backup runs
    cancel_while_decoding         ... once the decode side has the request

Every answer is compared with a recompute in this process (``pd.faults.wrong``); a request
not answered (or a cancel not done) within ``HANG_S`` is hung (``pd.faults.hung``); one
answered with an error is failed (``pd.faults.failed``); after each scenario both sides
must hold no page once idle (``pd.faults.leaked_pages``). All targets are 0.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import ray

from actors.deployment import Deployment
from actors.pd import PDConfig, PDDeployment, PDResult
from actors.shards import NAMESPACE
from actors.stores import drop_store
from apps.bench.workload import random_tokens
from apps.experiments import embedded_ray, shared_storage
from apps.report import Figure, figure
from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.storage_config import Fault, RayStorageOptions
from hicache_ray.engine.model import preset
from hicache_ray.engine.reference import recompute
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.serving.pd_split import SplitPolicy

__all__ = ["PD_FAULT_SCENARIOS", "run_pd_faults"]

HANG_S = 120.0
WRITE_DELAY_S = 0.03  # per write call: about 1 s for a prompt's backup
_PROMPT, _NEW = 256, 8

# A scenario's answer: the prompt answered and the pair's result, or None (cancelled).
# ``late``: the fault came after the request had its answer (it tested nothing then).
Answer = tuple[list[int], PDResult, bool] | None
Scenario = Callable[[PDDeployment, GenerateRequest], Awaitable[Answer]]


def _rank(deployment: Deployment, rank: int) -> Any:
    return deployment.ranks[rank]  # the serving generation's


async def _until(condition: Callable[[], bool], task: asyncio.Task[Any]) -> None:
    """Wait until ``condition`` holds (checked off the loop) or ``task`` ends."""
    while not task.done() and not await asyncio.to_thread(condition):
        await asyncio.sleep(0.02)


def _backing_up(pair: PDDeployment) -> bool:
    return any(
        r.controller is not None and r.controller.pending_backups > 0
        for r in pair.prefill.stats().ranks
    )


async def _killed_during(
    pair: PDDeployment, request: GenerateRequest, when: Callable[[], bool], kill: Callable[[], None]
) -> Answer:
    task = asyncio.ensure_future(pair.generate_async(request))
    await _until(when, task)
    late = task.done()
    kill()
    return request.tokens, await task, late


def _kill_shards(pair: PDDeployment) -> None:
    store = pair.config.prefill.cache.storage.ray
    for i in range(store.num_shards):
        shard = ray.get_actor(f"hicache-l3-{store.name}-{i}", namespace=NAMESPACE)
        ray.kill(shard, no_restart=False)  # it restarts empty, as a lost node's would


async def _cancelled_when(
    pair: PDDeployment, request: GenerateRequest, when: Callable[[], bool]
) -> Answer:
    task = asyncio.ensure_future(pair.generate_async(request))
    await _until(when, task)
    task.cancel()
    try:
        return request.tokens, await task, True  # answered before the cancel landed
    except asyncio.CancelledError:
        return None


async def _after_backup(pair: PDDeployment, request: GenerateRequest) -> Answer:
    first = await pair.generate_async(request)
    await asyncio.to_thread(pair.prefill.wait_idle, 60.0)  # its pages are in L3
    ray.kill(_rank(pair.prefill, 0))
    tokens = request.tokens + first.result.output_tokens + random_tokens(512, 128, 77)
    rid = request.rid + "-next"
    return tokens, await pair.generate_async(GenerateRequest(rid, tokens, _NEW)), False


async def _crash_mid_prefill(pair: PDDeployment, request: GenerateRequest) -> Answer:
    from actors.faults import RankFault

    await asyncio.to_thread(
        ray.get, _rank(pair.prefill, 1).inject.remote(RankFault.crash("prefill"))
    )
    return request.tokens, await pair.generate_async(request), False


def _scenarios() -> dict[str, Scenario]:
    def inflight(pair: PDDeployment) -> Callable[[], bool]:
        return lambda: pair.stats().inflight_tokens > 0

    def handed(pair: PDDeployment) -> Callable[[], bool]:
        before = pair.stats().handoff_pages
        return lambda: pair.stats().handoff_pages > before

    return {
        "prefill_killed_mid_prefill": _crash_mid_prefill,
        "prefill_killed_before_backup": lambda p, r: _killed_during(
            p, r, lambda: _backing_up(p), lambda: ray.kill(_rank(p.prefill, 0))
        ),
        "prefill_killed_after_backup": _after_backup,
        "store_shard_killed": lambda p, r: _killed_during(
            p, r, lambda: _backing_up(p), lambda: _kill_shards(p)
        ),
        "decode_killed_while_waiting": lambda p, r: _killed_during(
            p, r, inflight(p), lambda: ray.kill(_rank(p.decode, 0))
        ),
        "cancel_while_prefilling": lambda p, r: _cancelled_when(p, r, inflight(p)),
        "cancel_while_handing_off": lambda p, r: _cancelled_when(p, r, lambda: _backing_up(p)),
        "cancel_while_decoding": lambda p, r: _cancelled_when(p, r, handed(p)),
    }


PD_FAULT_SCENARIOS = tuple(_scenarios())


def _config(store: str) -> PDConfig:
    model = preset("tiny4")
    storage = shared_storage(f"reference/{model.name}", RayStorageOptions(name=store))
    cache = CacheConfig(
        memory=MemoryConfig(page_size=8, device_tokens=2048),
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
        storage=storage,
    )
    base = DeploymentConfig(
        name=f"pd-faults-{os.getpid()}",
        model=model,
        cache=cache,
        host_budget_bytes=32 << 20,
        consensus_timeout_s=5.0,
        cpus_per_rank=0.5,
    )
    policy = SplitPolicy(min_uncached_tokens=64, min_uncached_share=0.2, wait_base_s=5.0)
    pair = PDConfig.pair(base, prefill_tp=2, decode_tp=1, policy=policy)
    slow = msgspec.structs.replace(
        pair.prefill.cache.storage, faults=(Fault(op="write", kind="delay", delay_s=WRITE_DELAY_S),)
    )
    prefill = msgspec.structs.replace(
        pair.prefill, cache=msgspec.structs.replace(pair.prefill.cache, storage=slow)
    )
    return msgspec.structs.replace(pair, prefill=prefill)


def _leaked(pair: PDDeployment) -> int:
    """Pages either side still holds once idle (a lock leaked by the scenario)."""
    held = 0
    for side in (pair.prefill, pair.decode):
        side.generate([GenerateRequest("ping", [1, 2, 3], 1)])  # a killed rank: re-formed
        side.wait_idle(timeout_s=HANG_S)
        for rank in range(side.config.world_size):
            used = ray.get(_rank(side, rank).evict_all.remote(), timeout=60)
            held += used["device_pages_used"] + used["host_pages_used"]
    return held


def _run_one(pair: PDDeployment, name: str, scenario: Scenario, seed: int) -> dict[str, Any]:
    vocab = pair.config.decode.model.vocab_size
    request = GenerateRequest(name, random_tokens(vocab, _PROMPT, 3000 + seed), _NEW)
    row: dict[str, Any] = {"scenario": name, "wrong": 0, "hung": 0, "failed": 0, "late": False}
    started = time.monotonic()
    try:
        answer = asyncio.run(asyncio.wait_for(scenario(pair, request), HANG_S))
    except TimeoutError:
        row["hung"] = 1
        answer = None
    except Exception as exc:
        row["failed"], row["error"] = 1, f"{type(exc).__name__}: {exc}"
        answer = None
    row["seconds"] = round(time.monotonic() - started, 2)
    if answer is not None:
        tokens, out, row["late"] = answer
        if out.result.error is not None:
            row["failed"], row["error"] = 1, out.result.error
        else:
            row["wrong"] = int(
                out.result.output_tokens != recompute(pair.config.decode.model, tokens, _NEW)
            )
        row.update(
            split=out.split,
            l3_tokens=out.result.storage_hit_tokens,
            prefill_error=out.prefill_error,
            handoff_missing=out.handoff_missing,
        )
    row["leaked_pages"] = _leaked(pair)
    return row


def run_pd_faults(log: Callable[[str], None]) -> tuple[list[Figure], list[dict[str, Any]]]:
    """The fault table's figures and one row per scenario (see the module docstring)."""
    store = f"pd-faults-{os.getpid()}"
    rows = []
    with embedded_ray(4):
        try:
            pair = PDDeployment.launch(_config(store))
            try:
                for seed, (name, scenario) in enumerate(_scenarios().items()):
                    row = _run_one(pair, name, scenario, seed)
                    log(f"pd faults: {row}")
                    rows.append(row)
            finally:
                pair.shutdown()
        finally:
            drop_store(store)
    figures = [
        figure(
            f"pd.faults.{k}",
            float(sum(r[k] for r in rows)),
            "requests" if k != "leaked_pages" else "pages",
            target=0.0,
            better="lower",
        )
        for k in ("wrong", "hung", "failed", "leaked_pages")
    ]
    return [*figures, figure("pd.faults.scenarios", float(len(rows)), "scenarios")], rows
