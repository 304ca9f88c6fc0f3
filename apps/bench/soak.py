"""``hicache-ray bench soak``: many clients, small pools, every tier, faults, bounded in time.

Clients hold conversations on a TP=2 deployment whose L1/L2 are far smaller than the
working set, over a ``ray`` L3 whose writes sometimes fail or store corrupt pages and whose
reads are sometimes slow. Every ``fault_every_s`` one rank is crashed (at admit, prefill or
decode) or stalled past the consensus timeout, and the deployment must re-form and retry.
A conversation restarts when its prompt would outgrow the pool.

Afterwards: every request answered; a sample re-run from scratch gives the same tokens; after
the drain, evicting everything leaves no page in use on any rank (no lock leaked) and the
cache invariants hold; once the L3 store is cleared the object store is back to where it
started.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import ray

from actors.deployment import Deployment
from actors.faults import Phase, RankFault
from actors.inspect import object_store_usage
from actors.stores import drop_store
from apps.bench.options import SoakOptions
from apps.experiments import embedded_ray, shared_storage
from apps.report import Figure, figure
from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.storage_config import Fault, RayStorageOptions
from hicache_ray.engine.model import preset
from hicache_ray.engine.reference import recompute
from hicache_ray.engine.request import GenerateRequest, RequestResult
from hicache_ray.engine.spec import DeploymentConfig

__all__ = ["SoakOptions", "run_soak"]

_PHASES: dict[str, Phase] = {"admit": "admit", "prefill": "prefill", "decode": "decode"}

_DRAIN_POLL_S = 0.5  # how often the drain checks that the object store emptied


def _config(opts: SoakOptions, store: RayStorageOptions) -> DeploymentConfig:
    faults = (
        Fault(op="write", kind="fail", probability=0.05),
        Fault(op="write", kind="corrupt", probability=0.05),
        Fault(op="read", kind="delay", probability=0.1, delay_s=0.05),
    )
    cache = CacheConfig(
        memory=MemoryConfig(page_size=opts.page_size, device_tokens=opts.device_tokens),
        prefetch=PrefetchConfig(policy="timeout", threshold_tokens=0, timeout_base_s=0.5),
        storage=shared_storage(opts.model, store, faults=faults, fault_seed=opts.seed),
    )
    return DeploymentConfig(
        name="soak",
        model=preset(opts.model),
        tp_size=2,
        cache=cache,
        host_budget_bytes=32 << 20,
        consensus_timeout_s=3.0,
        max_retries=3,
    )


def _inject(deployment: Deployment, rnd: random.Random) -> str | None:
    """Crash or stall one rank of the current generation; returns what was done, or None
    when no rank could be reached (the deployment is re-forming: try again later)."""
    rank = rnd.randrange(deployment.config.world_size)
    kind = rnd.choice(["admit", "prefill", "decode", "stall"])
    ranks = deployment.ranks  # empty while the deployment re-forms
    if rank >= len(ranks):
        return None
    actor = ranks[rank]
    if kind == "stall":
        actor.inject.remote(RankFault.pause(10 * deployment.config.consensus_timeout_s))
    else:
        actor.inject.remote(RankFault.crash(_PHASES[kind]))
    return f"rank {rank} {kind}"


class _Load:
    """Clients chatting with a deployment while faults are injected: what was served."""

    def __init__(self, opts: SoakOptions, deployment: Deployment, rnd: random.Random) -> None:
        self.opts, self.deployment, self.rnd = opts, deployment, rnd
        self.vocab = preset(opts.model).vocab_size
        self.limit = opts.device_tokens // (2 * opts.concurrency)  # running requests fit
        self.history: list[list[int]] = [[] for _ in range(opts.clients)]
        self.running: dict[Future[RequestResult], tuple[int, list[int]]] = {}
        self.idle = list(range(opts.clients))
        self.served: list[tuple[list[int], RequestResult]] = []
        self.failed = self.injected = self.count = 0

    def run(self, log: Callable[[str], None]) -> None:
        opts = self.opts
        started = time.monotonic()
        next_fault = started + opts.fault_every_s
        while time.monotonic() - started < opts.duration_s or self.running:
            while self.idle and len(self.running) < opts.concurrency:
                if time.monotonic() - started >= opts.duration_s:
                    break
                self._send(self.idle.pop(0))
            if time.monotonic() >= next_fault and self.running:
                what = _inject(self.deployment, self.rnd)
                if what is not None:
                    log(f"soak: injecting {what}")
                    self.injected += 1
                    next_fault += opts.fault_every_s
            done, _ = wait(self.running, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in done:
                self._collect(future, log)

    def _send(self, c: int) -> None:
        opts = self.opts
        turn = [self.rnd.randrange(self.vocab) for _ in range(opts.turn_tokens)]
        if len(self.history[c]) + opts.turn_tokens + 2 * opts.answer_tokens > self.limit:
            self.history[c] = []  # a new conversation
        prompt = self.history[c] + turn
        request = GenerateRequest(f"soak-{self.count}", prompt, opts.answer_tokens)
        self.running[self.deployment.submit(request)] = (c, prompt)
        self.count += 1

    def _collect(self, future: Future[RequestResult], log: Callable[[str], None]) -> None:
        c, prompt = self.running.pop(future)
        self.idle.append(c)
        try:
            result = future.result()
        except Exception as exc:
            log(f"soak: a request failed: {exc}")
            self.failed += 1
            return
        if result.error is not None:
            self.failed += 1
            log(f"soak: {result.rid} refused: {result.error}")
            return
        self.served.append((prompt, result))
        self.history[c] = prompt + result.output_tokens


def run_soak(opts: SoakOptions, log: Callable[[str], None]) -> list[Figure]:
    rnd = random.Random(opts.seed)
    model = preset(opts.model)
    store = RayStorageOptions(name=f"soak-{os.getpid()}", num_shards=2)
    with embedded_ray(2):
        baseline = object_store_usage()
        deployment = Deployment.launch(_config(opts, store))
        try:
            load = _Load(opts, deployment, rnd)
            load.run(log)
            deployment.wait_idle(timeout_s=120)
            leaks = _leaked_pages(deployment)
            reforms = list(deployment.reforms)
        finally:
            deployment.shutdown()
            drop_store(store.name)  # its shards go, and every object they owned with them
        drained = _wait_drained(baseline)
    served, failed, injected = load.served, load.failed, load.injected
    sample = rnd.sample(served, min(opts.check, len(served)))
    wrong = sum(r.output_tokens != recompute(model, p, opts.answer_tokens) for p, r in sample)
    hits = sum(r.device_hit_tokens + r.host_hit_tokens for _, r in served)
    l3 = sum(r.storage_hit_tokens for _, r in served)
    recovery = max((x.seconds for x in reforms), default=0.0)
    log(
        f"soak: {len(served)} requests served, {failed} failed, {wrong} of {len(sample)} sampled "
        f"wrong, {injected} faults injected, {len(reforms)} re-formings (longest "
        f"{recovery:.2f} s), {hits} hit tokens ({l3} from L3), {leaks} pages left after "
        f"evicting everything, object store {'back to' if drained else 'NOT back to'} baseline"
    )
    return [
        figure("soak.requests", len(served), "requests"),
        figure("soak.failed_requests", failed, "requests", target=0, better="lower"),
        figure("soak.wrong_outputs", wrong, "requests", target=0, better="lower"),
        figure("soak.faults_injected", injected, "faults"),
        figure("soak.faults_survived", len(reforms), "re-formings"),
        figure("soak.recovery_s_max", recovery, "s", better="lower"),
        figure("soak.hit_tokens", hits, "tokens"),
        figure("soak.leaked_pages", leaks, "pages", target=0, better="lower"),
        figure("soak.object_store_leaked", 0 if drained else 1, "bool", target=0, better="lower"),
    ]


def _leaked_pages(deployment: Deployment) -> int:
    """Pages still in use on any rank after evicting everything (integrity checked too)."""
    answers: list[Any] = ray.get([r.evict_all.remote() for r in deployment.ranks])
    return sum(a["device_pages_used"] + a["host_pages_used"] for a in answers)


def _wait_drained(baseline: tuple[int, int], timeout_s: float = 60.0) -> bool:
    """Whether the object store returns to ``baseline`` (Ray frees objects asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        mib, objects = object_store_usage()
        if mib <= baseline[0] and objects <= baseline[1]:
            return True
        time.sleep(_DRAIN_POLL_S)
    return False
