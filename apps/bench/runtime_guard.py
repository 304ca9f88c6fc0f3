"""``bench runtime`` with a store slower than compute: the recompute guard on the real path.

A TP=1 deployment over the ray store whose reads are slowed by an injected delay
(``SLOW_READ_S`` a read) serves, on a fresh deployment, prompts of 1,024 tokens (the L3-hit
figures' prefix, capped: this keeps the run short) plus 16: one nothing holds (twice: the
second is the recompute reference, the first feeds the rank's compute rate), then three
prompts whose prefixes L3 holds. With the guard on (the default), the first L3 hit waits
at most what computing its tokens takes (nothing measured the store yet) and the rank learns
the store's rate from it; the later hits skip the read and compute.
``runtime.slow_store.hit_vs_recompute``: the median TTFT at the caller of the three hits
over the recompute's (target <= 1.1); ``.unguarded``: the same with
``prefetch.recompute_guard`` off (the previous behaviour: wait up to the ``timeout``
policy's deadline); ``.first_hit_vs_recompute``: the first hit alone, guard on.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import msgspec

from actors.deployment import Deployment
from apps.bench.workload import random_tokens
from apps.report import Figure, figure
from hicache_ray.base.config import CacheConfig
from hicache_ray.base.storage_config import Fault
from hicache_ray.engine.model import ModelConfig
from hicache_ray.engine.request import GenerateRequest, RequestResult
from hicache_ray.engine.spec import DeploymentConfig

__all__ = ["SLOW_READ_S", "guard_figures"]

SLOW_READ_S = 2.0  # injected delay of every L3 read call
_HITS = 3

StorePrefix = Callable[[ModelConfig, CacheConfig, list[int]], None]


def _slow(cache: CacheConfig, guard: bool) -> CacheConfig:
    slow = Fault(op="read", kind="delay", delay_s=SLOW_READ_S)
    storage = msgspec.structs.replace(cache.storage, faults=(slow,))
    prefetch = msgspec.structs.replace(cache.prefetch, recompute_guard=guard)
    return msgspec.structs.replace(cache, storage=storage, prefetch=prefetch)


def _run(
    model: ModelConfig, cache: CacheConfig, prefixes: list[list[int]], guard: bool
) -> tuple[float, list[float]]:
    """The recompute TTFT and each hit's, at the caller, on a fresh slow deployment."""
    vocab, length = model.vocab_size, len(prefixes[0])
    name = f"bench-guard-{int(guard)}-{os.getpid()}"
    dep = Deployment.launch(DeploymentConfig(name=name, model=model, cache=_slow(cache, guard)))
    try:
        out: list[RequestResult] = []
        for i in range(2):  # nothing holds these: computed in full
            tokens = random_tokens(vocab, length + 16, 8100 + 10 * i + int(guard))
            out += dep.generate([GenerateRequest(f"compute{i}", tokens, 1)])
        for k, prefix in enumerate(prefixes):
            tokens = prefix + random_tokens(vocab, 16, 8200 + k)
            out += dep.generate([GenerateRequest(f"hit{k}", tokens, 1)])
        dep.wait_idle(timeout_s=300)
    finally:
        dep.shutdown()
    for r in out:
        if r.error is not None:
            raise RuntimeError(f"bench request failed: {r.error}")
    return out[1].caller_ttft_s * 1e3, [r.caller_ttft_s * 1e3 for r in out[2:]]


def guard_figures(
    model: ModelConfig,
    cache: CacheConfig,
    length: int,
    store_prefix: StorePrefix,
    log: Callable[[str], None],
) -> list[Figure]:
    """The figures (on a running Ray, with ``cache`` over its shared ray store)."""
    prefixes = [random_tokens(model.vocab_size, length, 7000 + k) for k in range(_HITS)]
    for prefix in prefixes:
        store_prefix(model, cache, prefix)
    found: list[Figure] = []
    for guard in (True, False):
        recompute, hits = _run(model, cache, prefixes, guard)
        hit = statistics.median(hits)
        shown = ", ".join(f"{h:.0f}" for h in hits)
        log(
            f"runtime: store slower than compute (guard {'on' if guard else 'off'}): L3 hits "
            f"{shown} ms at the caller, recompute {recompute:.0f} ms"
        )
        suffix = "" if guard else ".unguarded"
        target = 1.1 if guard else None
        found.append(
            figure(
                f"runtime.slow_store.hit_vs_recompute{suffix}",
                hit,
                "ms",
                ceiling=recompute,
                target=target,
                better="lower",
            )
        )
        if guard:
            first = figure(
                "runtime.slow_store.first_hit_vs_recompute",
                hits[0],
                "ms",
                ceiling=recompute,
                better="lower",
            )
            found.append(first)
    return found
