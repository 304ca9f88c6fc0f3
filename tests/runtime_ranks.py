"""Rank processes of the TP=2 runtime test: two groups (consensus, model) on one store."""

from __future__ import annotations

from typing import Any

import torch

from hicache_ray.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.controller import CacheController, GlooConsensus, start_rendezvous
from hicache_ray.layout import Shard, ShardKV
from hicache_ray.model import ReferenceModel, gloo_tp_all_reduce, preset
from hicache_ray.runtime import GenerateRequest, RankRuntime

PAGE = 4
MODEL = preset("tiny")
TIMEOUT_S = 300.0


def tp_rank_main(rank: int, world: int, ports: Any, out: Any, requests: list[Any]) -> None:
    torch.set_num_threads(1)
    groups = []
    if rank == 0:
        rendezvous = start_rendezvous(world, timeout_s=TIMEOUT_S)
        for _ in range(world - 1):
            ports.put(rendezvous.port)
        port = rendezvous.port
        for name in ("hicache", "model"):
            groups.append(
                GlooConsensus(
                    0,
                    world,
                    "127.0.0.1",
                    port,
                    timeout_s=TIMEOUT_S,
                    name=name,
                    rendezvous=rendezvous,
                )
            )
    else:
        port = ports.get(timeout=60)
        for name in ("hicache", "model"):
            groups.append(
                GlooConsensus(rank, world, "127.0.0.1", port, timeout_s=TIMEOUT_S, name=name)
            )
    consensus, model_group = groups
    shard = Shard(tp_rank=rank, tp_size=world)
    config = CacheConfig(
        memory=MemoryConfig(page_size=PAGE, device_tokens=256),
        prefetch=PrefetchConfig(policy="wait_complete"),
    )
    kv = ShardKV(model=MODEL.model_kv(), shard=shard, page_size=PAGE)
    ctl = CacheController(config, kv, consensus=consensus, host_budget_bytes=1 << 30)
    model = ReferenceModel(MODEL, shard, tp_all_reduce=gloo_tp_all_reduce(model_group.group))
    rt = RankRuntime(ctl, model, keep_logits=True)
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
    ctl.close()
    for g in groups:
        g.close()
