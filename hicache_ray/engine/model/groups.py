"""Process groups for the model's collectives: NCCL on CUDA, gloo on CPU.

The model's TP all-reduces and PP transfers move activations every layer, so on GPUs they
use NCCL (device to device, no host round trip); the cache consensus always stays on its
own gloo group (CPU, small integer vectors). Both are built on the deployment's one
rendezvous store, each under its own prefix, and neither touches the process's default
group.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from hicache_ray.base.errors import CollectiveError
from hicache_ray.cache.controller.consensus import GlooConsensus, Rendezvous

__all__ = ["model_backend", "model_group"]

log = logging.getLogger(__name__)


def model_backend(device: torch.device) -> str:
    """``nccl`` for a CUDA device (when this torch has NCCL), else ``gloo``."""
    if device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def model_group(
    backend: str,
    rank: int,
    size: int,
    host: str,
    port: int,
    *,
    name: str,
    timeout_s: float,
    rendezvous: Rendezvous | None = None,
) -> Any:
    """A ``backend`` process group of ``size`` ranks named ``name`` on the rendezvous store.

    Raises:
        CollectiveError: the group could not be joined.
    """
    if backend == "gloo":
        return GlooConsensus(
            rank, size, host, port, timeout_s=timeout_s, name=name, rendezvous=rendezvous
        ).group
    if backend != "nccl":
        raise ValueError(f"unknown process group backend {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = (
            rendezvous.store
            if rendezvous is not None
            else TCPStore(host, port, size, is_master=False, timeout=timeout)
        )
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(PrefixStore(f"hicache/{name}", store), rank, size, options)
    except (RuntimeError, dist.DistError) as exc:
        raise CollectiveError(
            f"NCCL group {name!r}: rank {rank} of {size} did not join: {exc}"
        ) from exc
    log.info("group %s: NCCL (rank %d of %d)", name, rank, size)
    return group
