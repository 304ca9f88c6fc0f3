"""``bench route``: what one decision of the cache router costs, beside the requests.

The router's own work per call, as :class:`~actors.routing.CacheAwareRouter` does it: hash
the prompt's pages, read what each replica holds from its copy of the application's
index (kept from the index actor's change log), weigh the work pending, rank. Timed at
4,096-token prompts against an index that holds ``held_pages`` pages per replica (every
page of half the prompts, so hits are found and counted), over ``decisions`` calls:
``route.router_cost_ms.p50`` / ``.p99`` (target p99 <= 2 ms). ``.asking_p50`` /
``.asking_p99``: the same with the index actor asked instead (what a router whose copy
is more than a second old does). The ingress's tokenizer is not counted: the engine
needs the tokens anyway, and the router reads them from the call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import ray

from apps.bench.workload import random_tokens
from apps.experiments import embedded_ray
from apps.report import Figure, figure, percentile
from hicache_ray.cache.events import AllBlocksCleared, BlockStored, EventBatch, KVEventBatch
from hicache_ray.keys import page_hashes
from hicache_ray.serving.cache_index import Hits
from hicache_ray.serving.index_feed import IndexCopy
from hicache_ray.serving.route_cost import InFlight, RouteWeights, rank_replicas

__all__ = ["router_cost_figures"]


def router_cost_figures(
    vocab: int,
    page_size: int,
    log: Callable[[str], None],
    *,
    prompt_len: int = 4096,
    replicas: int = 2,
    held_pages: int = 16_384,
    decisions: int = 200,
) -> list[Figure]:
    """The p50 and p99 of one decision, in ms (see the module docstring)."""
    from actors.index_actor import index_actor

    names = [f"replica-{i}" for i in range(replicas)]
    prompts = [random_tokens(vocab, prompt_len, 40_000 + i) for i in range(decisions)]
    with embedded_ray(1):
        index = index_actor(f"route-cost-{os.getpid()}")
        try:
            for i, name in enumerate(names):  # replica i holds prompts i, i + replicas, ...
                mine = prompts[i::replicas][: decisions // 2]
                held = [h for p in mine for h in page_hashes(p, page_size)]
                filler = [f"{n:064x}" for n in range(max(0, held_pages - len(held)))]
                stored = BlockStored(held + filler, None, [], page_size, medium="GPU")
                batch = KVEventBatch(time.time(), [AllBlocksCleared(), stored])
                ray.get(index.reset.remote(name, EventBatch(name, 1, batch)))
            copy = IndexCopy()
            copy.update(ray.get(index.changes.remote(copy.epoch, copy.seq)))
            local = [_decide(copy.index.facts, names, p, page_size) for p in prompts]
            asking = [_decide(_asker(index), names, p, page_size) for p in prompts]
        finally:
            ray.kill(index)
    ms = {k: [t * 1e3 for t in v] for k, v in (("", local), ("asking_", asking))}
    log(
        f"route: a cache-router decision at {prompt_len} tokens: p50 "
        f"{percentile(ms[''], 50):.2f}, p99 {percentile(ms[''], 99):.2f} ms (asking the index "
        f"actor: {percentile(ms['asking_'], 50):.2f}, {percentile(ms['asking_'], 99):.2f} ms)"
    )
    return [
        figure(
            f"route.router_cost_ms.{kind}p{p}",
            percentile(values, p),
            "ms",
            target=2.0 if not kind and p == 99 else None,
            better="lower",
        )
        for kind, values in ms.items()
        for p in (50, 99)
    ]


Facts = Callable[[list[str], list[str]], tuple[dict[str, Hits], dict[str, int]]]


def _asker(index: Any) -> Facts:
    return lambda names, hashes: ray.get(index.facts.remote(names, hashes))


def _decide(facts: Facts, names: list[str], tokens: list[int], page_size: int) -> float:
    """Seconds one decision takes, the router's steps in its order."""
    flight = InFlight()
    start = time.perf_counter()
    hashes = page_hashes(tokens, page_size)
    hits, held = facts(names, hashes)
    pending = flight.pending({name: 1 for name in names}, typical=float(len(tokens)))
    rank_replicas(names, hits, pending, len(tokens), page_size, RouteWeights(), held)
    return time.perf_counter() - start
