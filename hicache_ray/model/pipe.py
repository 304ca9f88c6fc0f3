"""Pipeline parallelism across ranks: hidden states down the stages, the token back to all.

Rank ``r`` is stage ``r // tp_size``, TP rank ``r % tp_size``. After its layers, each TP
rank of a stage holds the full hidden states (the TP all-reduces make them identical), so
it sends them to the same TP rank of the next stage. The last stage samples the token
(greedy; identical on its TP ranks) and rank ``(pp_size - 1) * tp_size`` broadcasts it, so
every rank appends the same token and inserts the same KV. Every rank makes the same calls
in the same order (the runtime's steps are deterministic given the agreed facts), so the
sends and receives always pair up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hicache_ray.errors import CollectiveError
from hicache_ray.layout import DTYPES
from hicache_ray.memory.device_pool import DevicePool
from hicache_ray.model.transformer import ReferenceModel

__all__ = ["StagePipe", "local_token"]


class StagePipe:
    """The point-to-point and broadcast calls of one rank of a TP x PP deployment.

    Args:
        group: a gloo process group over every rank of the deployment (its own, not the
            cache consensus group).
        rank, tp_size, pp_size: this rank's coordinates.
    """

    def __init__(self, group: Any, rank: int, tp_size: int, pp_size: int) -> None:
        self.group = group
        self.rank = rank
        self.tp_size = tp_size
        self.pp_rank = rank // tp_size
        self.pp_size = pp_size
        self._root = dist.BroadcastOptions()
        self._root.rootRank = (pp_size - 1) * tp_size
        self._root.rootTensor = 0
        self._token = torch.zeros(1, dtype=torch.int64)

    def forward_token(
        self,
        model: ReferenceModel,
        ids: torch.Tensor,
        pool: DevicePool,
        pages: Sequence[int],
        start: int,
        *,
        wait_layer: Callable[[int], None] | None = None,
    ) -> tuple[int, torch.Tensor | None]:
        """Run this stage over ``ids`` (every rank passes the token ids); returns the
        sampled token (on every rank) and the last position's logits (last stage only)."""
        x: torch.Tensor = ids
        if self.pp_rank > 0:
            dtype = DTYPES[model.config.dtype]
            x = torch.empty((ids.shape[0], model.config.hidden_size), dtype=dtype)
            _wait(self.group.recv([x], self.rank - self.tp_size, 0), "receive")
            x = x.to(model.device)
        out = model.forward(x, pool, pages, start, wait_layer=wait_layer)
        logits = None
        if self.pp_rank < self.pp_size - 1:
            _wait(self.group.send([out.contiguous().cpu()], self.rank + self.tp_size, 0), "send")
        else:
            logits = out[-1]
            self._token[0] = int(logits.argmax())
        _wait(self.group.broadcast([self._token], self._root), "token broadcast")
        return int(self._token[0]), logits


def _wait(work: Any, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:  # a timeout, a dead peer: the group is broken
        raise CollectiveError(f"PP {what} failed: {exc}") from exc


def local_token(
    model: ReferenceModel,
    ids: torch.Tensor,
    pool: DevicePool,
    pages: Sequence[int],
    start: int,
    *,
    wait_layer: Callable[[int], None] | None = None,
) -> tuple[int, torch.Tensor | None]:
    """One stage holding every layer: the greedy token and the last position's logits."""
    logits = model.forward(ids, pool, pages, start, wait_layer=wait_layer)[-1]
    return int(logits.argmax()), logits
