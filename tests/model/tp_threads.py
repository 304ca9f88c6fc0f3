"""Two TP ranks of the reference model as two threads of one process, summing their
partials at every all-reduce (TP over gloo in separate processes is tested with the
runtime)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from hicache_ray.layout import Shard
from hicache_ray.model import ReferenceModel


def tp2_forward(
    config: Any, forward: Callable[[ReferenceModel, Shard], torch.Tensor]
) -> list[torch.Tensor]:
    """``forward(model, shard)`` of each of the two TP=2 ranks, run at once."""
    partials: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    barrier = threading.Barrier(2)

    def summed(rank: int) -> Callable[[torch.Tensor], None]:
        def reduce(t: torch.Tensor) -> None:  # a SUM all-reduce between two threads
            partials[rank].append(t.clone())
            barrier.wait()
            t.copy_(partials[0][-1] + partials[1][-1])
            barrier.wait()

        return reduce

    shards = [Shard(tp_rank=r, tp_size=2) for r in range(2)]
    models = [ReferenceModel(config, s, tp_all_reduce=summed(r)) for r, s in enumerate(shards)]
    results: dict[int, torch.Tensor] = {}

    def run(r: int) -> None:
        results[r] = forward(models[r], shards[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return [results[0], results[1]]
