"""Rank processes of the TP=2 runtime test: two groups (consensus, model) on one store."""

from __future__ import annotations

from typing import Any

import torch

from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.cache.controller import start_rendezvous
from hicache_ray.engine.compose import RankPlace, compose_rank
from hicache_ray.engine.model import preset
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.engine.spec import DeploymentConfig

PAGE = 4
MODEL = preset("tiny")
TIMEOUT_S = 300.0


def tp_rank_main(rank: int, world: int, ports: Any, out: Any, requests: list[Any]) -> None:
    torch.set_num_threads(1)
    rendezvous = None
    if rank == 0:
        rendezvous = start_rendezvous(world, timeout_s=TIMEOUT_S)
        for _ in range(world - 1):
            ports.put(rendezvous.port)
        port = rendezvous.port
    else:
        port = ports.get(timeout=60)
    config = DeploymentConfig(
        model=MODEL,
        tp_size=world,
        cache=CacheConfig(
            memory=MemoryConfig(page_size=PAGE, device_tokens=256),
            prefetch=PrefetchConfig(policy="wait_complete"),
        ),
        host_budget_bytes=1 << 30,
        consensus_timeout_s=TIMEOUT_S,
        collective_timeout_s=TIMEOUT_S,
    )
    place = RankPlace(rank, meet=("127.0.0.1", port), rendezvous=rendezvous)
    composed = compose_rank(config, place, keep_logits=True)
    rt, ctl = composed.runtime, composed.controller
    results = {}
    for rid, tokens, max_new in requests:  # one at a time: the second reuses the first
        if rank == 0:
            rt.submit(GenerateRequest(rid, tokens, max_new))
        while rid not in results:
            for r in rt.step().results:
                results[r.rid] = r
            ctl.settle(timeout=60)
    out.put(
        (
            rank,
            {
                rid: (r.output_tokens, r.device_hit_tokens, rt.first_logits[rid].tolist())
                for rid, r in results.items()
            },
        )
    )
    composed.close()
