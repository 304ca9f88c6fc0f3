"""One batched forward across the ranks of a deployment, ending in the same tokens everywhere.

Rank ``r`` is stage ``r // tp_size``, TP rank ``r % tp_size``. After its layers, each TP rank
of a stage holds the whole batch's hidden states (the TP all-reduces make them identical),
so it sends them to the same TP rank of the next stage. The last stage computes the logits
and samples the tokens, and the root (TP rank 0 of the last stage) broadcasts them, so every
rank appends the same tokens and inserts the same KV. Every rank makes the same calls in the
same order (the runtime's batches are built from agreed facts), so the sends and receives
always pair up; a failed call raises :class:`~hicache_ray.base.errors.CollectiveError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hicache_ray.base.errors import CollectiveError
from hicache_ray.base.layout import DTYPES
from hicache_ray.cache.memory.device_pool import DevicePool
from hicache_ray.engine.model.transformer import ReferenceModel, Segment

__all__ = ["Sampler", "StageExecutor"]

# Rows of logits [B, vocab] -> one token per row (the runtime's sampling, per request).
Sampler = Callable[[torch.Tensor], list[int]]


def _wait(work: Any, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:  # a timeout, a dead peer: the group is broken
        raise CollectiveError(f"{what} failed: {exc}") from exc


class StageExecutor:
    """The forward of one rank and the calls that move its batch between ranks.

    Args:
        model: this rank's share of the model.
        rank, tp_size, pp_size: this rank's coordinates.
        pipe_group: a process group over every rank (hidden states between stages and the
            token broadcast); None for a single rank.
        comm_device: where tensors the group moves must live (CUDA for NCCL, CPU for gloo).
    """

    def __init__(
        self,
        model: ReferenceModel,
        rank: int = 0,
        tp_size: int = 1,
        pp_size: int = 1,
        pipe_group: Any = None,
        comm_device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.comm_device = comm_device or torch.device("cpu")
        self.rank = rank
        self.tp_size = tp_size
        self.pp_rank = rank // tp_size
        self.pp_size = pp_size
        self.group = pipe_group
        if pipe_group is None and tp_size * pp_size > 1:
            raise ValueError("a deployment of several ranks needs a pipe group")
        self._root = dist.BroadcastOptions()
        self._root.rootRank = (pp_size - 1) * tp_size
        self._root.rootTensor = 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def run(
        self,
        token_ids: torch.Tensor,
        segments: Sequence[Segment],
        pool: DevicePool,
        rows: Sequence[int],
        sample: Sampler,
        *,
        wait_layer: Callable[[int], None] | None = None,
        keep: Callable[[torch.Tensor], None] | None = None,
    ) -> list[int]:
        """Forward ``segments`` (their token ids concatenated; every rank passes them) and
        sample a token for each of ``rows``; returns the tokens, the same on every rank.
        ``keep`` sees the logits of ``rows`` (last stage; tests)."""
        model = self.model
        x: torch.Tensor = token_ids
        if self.pp_rank > 0:
            dtype = DTYPES[model.config.dtype]
            x = torch.empty(
                (token_ids.shape[0], model.config.hidden_size), dtype=dtype, device=self.comm_device
            )
            if token_ids.shape[0]:
                _wait(self.group.recv([x], self.rank - self.tp_size, 0), "PP receive")
        out = model.forward_batch(
            x, segments, pool, wait_layer=wait_layer, logit_rows=rows if self.last_stage else None
        )
        tokens = torch.zeros(len(rows), dtype=torch.int64, device=self.comm_device)
        if not self.last_stage:
            if token_ids.shape[0]:
                hidden = out.contiguous().to(self.comm_device)
                _wait(self.group.send([hidden], self.rank + self.tp_size, 0), "PP send")
        elif rows:
            if keep is not None:
                keep(out)
            tokens = torch.tensor(sample(out), dtype=torch.int64, device=self.comm_device)
        if self.group is not None and rows:
            _wait(self.group.broadcast([tokens], self._root), "token broadcast")
        return [int(t) for t in tokens.tolist()]
