"""How the ranks of one deployment agree: a MIN all-reduce of integers and a byte broadcast.

Two implementations of :class:`Consensus`: :class:`LocalConsensus` for a single rank
(identity, no communication) and :class:`GlooConsensus` over a dedicated
``torch.distributed`` gloo process group with an explicit timeout. The gloo group is built
directly on a TCP rendezvous store, so it neither needs nor disturbs the process's default
group (an engine's own NCCL group keeps working).

The rendezvous store is bound by rank 0 on port 0 (the kernel picks a free port; nothing is
guessed) with :func:`start_rendezvous`; rank 0 then hands ``(host, port)`` to the other
ranks out of band (a Ray call, a pipe in tests).

NOTE: the MIN all-reduce of a vector is a gather to rank 0, an element-wise minimum there and
a broadcast back: two hops whatever the group size. Gloo's ring all-reduce takes 2(n-1)
latency-bound hops per segment; for the few hundred bytes a step exchanges it measured 6-8x
slower than a one-integer all-reduce here, the gather + broadcast about 1-2x. A one-element
vector still uses the all-reduce.

Both methods run on the caller's thread and must be called by every rank in the same order
(see :mod:`hicache_ray.cache.controller.protocol`); a timeout or a dead peer raises
:class:`ConsensusError` naming the step and the group.
"""

from __future__ import annotations

import datetime
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from hicache_ray.base.errors import CollectiveError

__all__ = [
    "Consensus",
    "ConsensusError",
    "GlooConsensus",
    "LocalConsensus",
    "Rendezvous",
    "start_rendezvous",
]


class ConsensusError(CollectiveError):
    """A collective of the consensus group failed (timeout, dead peer): the group is broken
    and the deployment must be re-formed."""


class Consensus(ABC):
    """The collectives the cache controller needs, over one group of ranks."""

    name: str
    rank: int
    world_size: int

    @abstractmethod
    def all_reduce_min(self, values: Sequence[int], step: int) -> list[int]:
        """Element-wise minimum of ``values`` over every rank (same length everywhere)."""

    @abstractmethod
    def broadcast_bytes(self, payload: bytes, size: int, step: int) -> bytes:
        """Rank 0's ``payload`` of ``size`` bytes on every rank (others pass ``b""``)."""

    @abstractmethod
    def close(self) -> None:
        """Release the group; safe to call twice."""


class LocalConsensus(Consensus):
    """A group of one rank: every collective is the identity."""

    def __init__(self, name: str = "local") -> None:
        self.name = name
        self.rank = 0
        self.world_size = 1

    def all_reduce_min(self, values: Sequence[int], step: int) -> list[int]:
        return list(values)

    def broadcast_bytes(self, payload: bytes, size: int, step: int) -> bytes:
        if len(payload) != size:
            raise ValueError(f"broadcast of {len(payload)} bytes announced as {size}")
        return payload

    def close(self) -> None:
        pass


class Rendezvous:
    """Rank 0's TCP store; keep it alive as long as the group (its owner serves it)."""

    def __init__(self, store: TCPStore, host: str) -> None:
        self.store = store
        self.host = host
        self.port = int(store.port)


def start_rendezvous(
    world_size: int, host: str = "127.0.0.1", timeout_s: float = 60.0
) -> Rendezvous:
    """Bind rank 0's rendezvous store on a free port of ``host`` (port 0: the kernel picks)."""
    store = TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return Rendezvous(store, host)


class GlooConsensus(Consensus):
    """Consensus over a dedicated gloo process group.

    Args:
        rank, world_size: this rank's place in the group.
        host, port: the rendezvous store. The process that started it passes its
            :class:`Rendezvous` instead (as rank 0); the rank 0 of a group whose store
            another process serves (a subgroup) connects like the others.
        timeout_s: how long a collective (and the rendezvous) may wait for a peer.
        name: the group's name, used in errors and as the store prefix (several groups can
            share one store).
        rendezvous: rank 0's store, from :func:`start_rendezvous`.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        *,
        timeout_s: float = 60.0,
        name: str = "hicache",
        rendezvous: Rendezvous | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        if rendezvous is not None and rank != 0:
            raise ValueError("only rank 0 passes the rendezvous it started")
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self._rendezvous = rendezvous
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        try:
            store = (
                rendezvous.store
                if rendezvous is not None
                else TCPStore(host, port, world_size, is_master=False, timeout=timeout)
            )
            self._group: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
                PrefixStore(f"hicache/{name}", store), rank, world_size, options
            )
        except (RuntimeError, dist.DistError) as exc:
            raise ConsensusError(
                f"group {name!r}: rank {rank} of {world_size} could not join via {host}:{port} "
                f"within {timeout_s}s: {exc}"
            ) from exc
        self._min = dist.AllreduceOptions()
        self._min.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self._root = dist.BroadcastOptions()
        self._root.rootRank = 0
        self._root.rootTensor = 0
        self._one = torch.zeros(1, dtype=torch.int64)
        self._one_np = self._one.numpy()
        self._one_list = [self._one]
        self._gather = dist.GatherOptions()
        self._gather.rootRank = 0

    @property
    def group(self) -> Any:  # ProcessGroupGloo; its stubs lack the collectives
        """The underlying gloo group (benchmarks time bare collectives on it)."""
        if self._group is None:
            raise ConsensusError(f"group {self.name!r} is closed")
        return self._group

    def all_reduce_min(self, values: Sequence[int], step: int) -> list[int]:
        if len(values) == 1:  # the idle step's question: one persistent tensor, no copies
            self._one_np[0] = values[0]  # numpy view: torch indexing costs ~8 us here
            try:
                self.group.allreduce(self._one_list, self._min).wait()
            except RuntimeError as exc:
                raise self._error("all-reduce", step, exc) from exc
            return [int(self._one_np[0])]
        tensor = torch.tensor(values, dtype=torch.int64)
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            self._run(
                "all-reduce (gather)", step, lambda g: g.gather([parts], [tensor], self._gather)
            )
            tensor = torch.stack(parts).amin(0)
        else:
            self._run("all-reduce (gather)", step, lambda g: g.gather([], [tensor], self._gather))
        self._run("all-reduce (broadcast)", step, lambda g: g.broadcast([tensor], self._root))
        return tensor.tolist()

    def broadcast_bytes(self, payload: bytes, size: int, step: int) -> bytes:
        if self.rank == 0:
            if len(payload) != size:
                raise ValueError(f"broadcast of {len(payload)} bytes announced as {size}")
            tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            tensor = torch.empty(size, dtype=torch.uint8)
        self._run("broadcast", step, lambda g: g.broadcast([tensor], self._root))
        return tensor.numpy().tobytes()

    def _run(self, what: str, step: int, call: object) -> None:
        group = self._group
        if group is None:
            raise ConsensusError(f"group {self.name!r} is closed")
        try:
            call(group).wait()  # type: ignore[operator]
        except RuntimeError as exc:
            raise self._error(what, step, exc) from exc

    def _error(self, what: str, step: int, exc: RuntimeError) -> ConsensusError:
        return ConsensusError(
            f"step {step}: {what} over group {self.name!r} (rank {self.rank} of "
            f"{self.world_size}, timeout {self.timeout_s}s) failed: a peer timed out or "
            f"died ({exc}); re-form the deployment"
        )

    def close(self) -> None:
        self._group = None
        self._rendezvous = None
