"""The core inside an engine's own worker: one rank, no actors, no Ray.

An engine loop calls ``match`` (lock the cached prefix, start loading its host part),
``reserve`` (device pages for the new tokens), runs its forward pass over the pool (waiting
per layer on the load), and ``finish`` (insert the prompt and answer, apply the write
policy). Here the engine is the reference model; a three-turn conversation reuses more of
its history each turn, and every answer equals a from-scratch recompute (which runs a whole
rank of ours: ``hicache_ray.engine.compose.compose_rank`` builds its controller, model and runtime
from a ``DeploymentConfig``, the way an engine that takes our scheduler too would).

    python examples/embed_core.py
"""

from __future__ import annotations

import torch

from hicache_ray.base.config import CacheConfig, MemoryConfig
from hicache_ray.base.layout import Shard, ShardKV
from hicache_ray.cache.hicache import HiCache
from hicache_ray.engine.model import ReferenceModel, preset
from hicache_ray.engine.reference import recompute

PAGE = 16
MODEL = preset("tiny4")


def serve(
    cache: HiCache, model: ReferenceModel, tokens: list[int], max_new: int
) -> tuple[list[int], int]:
    """One request through the cache: its greedy answer and how many prompt tokens hit."""
    handle = cache.match(tokens, limit_pages=(len(tokens) - 1) // PAGE)  # keep 1 to compute
    cached = handle.num_cached_tokens
    cache.reserve(handle, len(tokens) - cached + max_new)
    pool, pages = cache.device_pool, handle.device_pages
    ids = torch.tensor(tokens[cached:])
    logits = model.forward(ids, pool, pages, cached, wait_layer=handle.wait_layer)
    answer = [int(logits[-1].argmax())]
    while len(answer) < max_new:
        position = len(tokens) + len(answer) - 1
        answer.append(
            int(model.forward(torch.tensor(answer[-1:]), pool, pages, position)[-1].argmax())
        )
    cache.finish(handle, tokens + answer[:-1])  # the last token's KV was never computed
    return answer, cached


def main() -> list[tuple[int, int, bool]]:
    """Per turn: prompt tokens, cached tokens, whether the answer equals recompute."""
    kv = ShardKV(model=MODEL.model_kv(), shard=Shard(), page_size=PAGE)
    cache = HiCache(CacheConfig(memory=MemoryConfig(page_size=PAGE, device_tokens=1024)), kv)
    model = ReferenceModel(MODEL)
    gen = torch.Generator().manual_seed(0)
    history: list[int] = []
    turns = []
    try:
        for turn in range(3):
            history += torch.randint(0, MODEL.vocab_size, (40,), generator=gen).tolist()
            answer, cached = serve(cache, model, history, 12)
            exact = answer == recompute(MODEL, history, 12)
            print(f"turn {turn}: {len(history)} prompt tokens, {cached} cached, exact={exact}")
            turns.append((len(history), cached, exact))
            history += answer
    finally:
        cache.close()
    return turns


if __name__ == "__main__":
    main()
