"""``hicache-ray bench faults``: every fault scenario, its outcome in figures.

Each scenario launches a TP deployment on a fresh ``ray`` L3, serves a first turn of a few
conversations (warming L1/L2/L3), injects its fault, serves the second turn (the fault
lands while it runs), then a third turn (the deployment and the store must serve again).
Every answer of turns two and three is compared with a from-scratch recompute.

    rank_killed_admit    rank 1 crashes when requests are admitted (prefetch queries running)
    rank_killed_prefill  rank 1 crashes entering a prefill
    rank_killed_decode   rank 1 crashes entering a decode step
    rank_stalled         rank 1 stalls past the consensus timeout
    l3_shard_killed      the store's shard actors are killed (restart empty)
    l3_corrupt_pages     30 % of stored pages are written corrupted (detected, dropped)
    l3_write_failures    half of the L3 writes fail (backups stop cleanly)
    l3_slow_reads        every L3 read takes 0.2 s (prefetch policy ``timeout``)

Figures: ``faults.<scenario>.wrong_outputs`` and ``.failed_requests`` (targets 0),
``.recovery_s``: for rank faults, the re-forming time; for a killed shard, until it answers
again; 0 for faults the deployment rides through; ``.l3_hit_tokens_after``: prompt tokens
the faulted turn took from L3 (after a rank fault the new ranks' pools are empty, so this
shows L3 survived intact).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import ray
import torch

from actors.deployment import Deployment
from actors.faults import Phase, RankFault
from actors.lifecycle import DeploymentError
from actors.shards import NAMESPACE
from actors.stores import drop_store, store_stats
from apps.bench.options import FAULT_SCENARIOS, FaultOptions
from apps.experiments import embedded_ray, shared_storage
from apps.report import Figure, figure
from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.storage_config import Fault, RayStorageOptions
from hicache_ray.engine.model import preset
from hicache_ray.engine.reference import recompute
from hicache_ray.engine.request import GenerateRequest, RequestResult
from hicache_ray.engine.spec import DeploymentConfig

__all__ = ["run_faults"]

_RANK_KILLED: dict[str, Phase] = {
    "rank_killed_admit": "admit",
    "rank_killed_prefill": "prefill",
    "rank_killed_decode": "decode",
}
_STORAGE_FAULTS = {
    "l3_corrupt_pages": (Fault(op="write", kind="corrupt", probability=0.3),),
    "l3_write_failures": (Fault(op="write", kind="fail", probability=0.5),),
    "l3_slow_reads": (Fault(op="read", kind="delay", delay_s=0.2),),
}


def _config(name: str, opts: FaultOptions, store: RayStorageOptions) -> DeploymentConfig:
    slow = name == "l3_slow_reads"
    cache = CacheConfig(
        memory=MemoryConfig(page_size=opts.page_size, device_tokens=opts.device_tokens),
        prefetch=PrefetchConfig(
            policy="timeout" if slow else "wait_complete",
            threshold_tokens=0,
            timeout_base_s=0.3,
        ),
        storage=shared_storage(
            opts.model, store, faults=_STORAGE_FAULTS.get(name, ()), fault_seed=opts.seed
        ),
    )
    return DeploymentConfig(
        name=f"faults-{name.replace('_', '-')}",
        model=preset(opts.model),
        tp_size=opts.tp_size,
        cache=cache,
        host_budget_bytes=64 << 20,
        consensus_timeout_s=opts.consensus_timeout_s,
    )


def _inject(name: str, deployment: Deployment, store: RayStorageOptions) -> None:
    if name in _RANK_KILLED:
        ray.get(deployment.ranks[1].inject.remote(RankFault.crash(_RANK_KILLED[name])))
    elif name == "rank_stalled":
        ray.get(
            deployment.ranks[1].inject.remote(
                RankFault.pause(10 * deployment.config.consensus_timeout_s)
            )
        )
    elif name == "l3_shard_killed":
        for i in range(store.num_shards):
            shard = ray.get_actor(f"hicache-l3-{store.name}-{i}", namespace=NAMESPACE)
            ray.kill(shard, no_restart=False)


@dataclass
class _Outcome:
    """What the turns after a fault got."""

    served: list[tuple[list[int], RequestResult]] = field(default_factory=list)
    l3_after: int = 0  # tokens the turn hit by the fault took from L3 (it is intact)
    failed: int = 0
    recovery: float = 0.0
    reforms: int = 0
    storage: dict[str, int] = field(default_factory=dict)


def _scenario(name: str, opts: FaultOptions, log: Callable[[str], None]) -> list[Figure]:
    store = RayStorageOptions(name=f"faults-{os.getpid()}-{name}", num_shards=2)
    config = _config(name, opts, store)
    model = config.model
    out = _Outcome()
    deployment = Deployment.launch(config)
    try:
        deployment = _turns(name, opts, deployment, store, out, log)
        if deployment.reforms:
            out.recovery = deployment.reforms[-1].seconds
        out.reforms = len(deployment.reforms)
        out.storage = _storage_counts(deployment)
    finally:
        deployment.shutdown()
        drop_store(store.name)
    wrong = sum(r.output_tokens != recompute(model, p, opts.answer_len) for p, r in out.served)
    log(
        f"{name}: {len(out.served)} requests after the fault, {wrong} wrong, {out.failed} "
        f"failed, recovered in {out.recovery:.2f} s, {out.reforms} re-forming(s), "
        f"{out.l3_after} tokens of the faulted turn from L3; storage: {out.storage}"
    )
    return [
        figure(f"faults.{name}.wrong_outputs", wrong, "requests", target=0, better="lower"),
        figure(f"faults.{name}.failed_requests", out.failed, "requests", target=0, better="lower"),
        figure(f"faults.{name}.recovery_s", out.recovery, "s", better="lower"),
        figure(f"faults.{name}.l3_hit_tokens_after", out.l3_after, "tokens"),
    ]


def _turns(
    name: str,
    opts: FaultOptions,
    deployment: Deployment,
    store: RayStorageOptions,
    out: _Outcome,
    log: Callable[[str], None],
) -> Deployment:
    """Three turns of every client, the fault injected before the second; returns the
    deployment serving at the end (storage faults continue on a second one)."""
    gen = torch.Generator().manual_seed(opts.seed)
    vocab = deployment.config.model.vocab_size
    history = [
        torch.randint(0, vocab, (opts.prompt_len,), generator=gen).tolist()
        for _ in range(opts.clients)
    ]
    injected = 0.0
    for turn in range(3):
        prompts = [h + [turn + 1] * 5 for h in history]
        if turn == 1 and name in _STORAGE_FAULTS:
            # A second deployment continues: its pools are empty, so the history must
            # come from (or be missed in) the faulty L3.
            config = deployment.config
            deployment.shutdown()
            deployment = Deployment.launch(msgspec.structs.replace(config, name=config.name + "-b"))
        if turn == 1:
            _inject(name, deployment, store)
            injected = time.monotonic()
        requests = [
            GenerateRequest(f"{name}-t{turn}-c{c}", p, opts.answer_len)
            for c, p in enumerate(prompts)
        ]
        try:
            results = deployment.generate(requests)
        except DeploymentError as exc:
            log(f"{name}: turn {turn} failed: {exc}")
            out.failed += len(requests)
            continue
        out.failed += sum(r.error is not None for r in results)
        if turn:
            out.served += list(zip(prompts, results, strict=True))
        if turn == 1:
            out.l3_after = sum(r.storage_hit_tokens for r in results)
        history = [p + r.output_tokens for p, r in zip(prompts, results, strict=True)]
        if turn == 1 and name == "l3_shard_killed":
            store_stats(store)  # answers again (restarted shards)
            out.recovery = time.monotonic() - injected
        deployment.wait_idle(timeout_s=120)
    return deployment


def _storage_counts(deployment: Deployment) -> dict[str, int]:
    """L3 hits and the storage failures the ranks detected (summed over ranks)."""
    keys = ("get_pages", "corrupt_pages", "put_failures", "get_failures")
    total = dict.fromkeys(keys, 0)
    for rank in deployment.stats().ranks:
        for key in keys:
            total[key] += getattr(rank.storage, key, 0)
    return total


def run_faults(opts: FaultOptions, log: Callable[[str], None]) -> list[Figure]:
    unknown = set(opts.scenarios) - set(FAULT_SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; use some of {FAULT_SCENARIOS}")
    figures: list[Figure] = []
    with embedded_ray(opts.tp_size):
        for name in opts.scenarios:
            figures += _scenario(name, opts, log)
    return figures
