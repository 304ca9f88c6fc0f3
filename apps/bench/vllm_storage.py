"""``hicache-ray bench storage --backend vllm``: the vLLM connector's page moves on the Ray
object store.

One vLLM worker of a Llama-3-8B-like model at TP=4 in a fleet of TP 4 and 8 (32 layers,
2 of 8 KV heads, head dim 128, 32-token blocks, bfloat16: 1 MiB per page, stored as two
512 KiB head-group objects) saves and loads batches of 128 blocks between its paged KV
(vLLM's CPU layout, ``cpu_vec``) and the store, through the connector's worker side
(:class:`~hicache_ray.integrations.vllm.pages.BlockMover`, the code the connector runs in
``wait_for_save`` and ``start_load_kv``). It needs no vLLM: the caches are tensors of
vLLM's shape. The ceiling, in the same run and interleaved with it, is the raw Ray object
store moving the same objects between the same blocks: one indexed gather per layer and
slot into staging and ``ray.put`` of it (saves); ``ray.get`` of objects another process
put, one copy into staging and one indexed scatter per layer and slot (loads). No keys,
index, checksum or verification.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from apps.bench.storage_ceilings import RawRay, ensure_ray, warm_object_store
from apps.report import Figure, figure, time_into
from hicache_ray.base.layout import ModelKV, Shard, ShardKV
from hicache_ray.base.storage_config import RayStorageOptions, StorageConfig
from hicache_ray.base.views import byte_view
from hicache_ray.integrations.vllm.blocks import BlockMover
from hicache_ray.integrations.vllm.pages import PageJob
from hicache_ray.keys import page_hashes, plan_objects
from hicache_ray.storage.registry import connect

__all__ = ["VLLMBenchOptions", "run_vllm_bench"]


@dataclass(frozen=True)
class VLLMBenchOptions:
    num_layers: int = 32
    num_kv_heads: int = 8
    tp_size: int = 4
    share_tp: tuple[int, ...] = (4, 8)
    head_dim: int = 128
    page_size: int = 32
    batch_pages: int = 128
    repeats: int = 9

    @classmethod
    def quick(cls) -> VLLMBenchOptions:
        return cls(num_layers=2, head_dim=32, batch_pages=16, repeats=2)


def _caches(opts: VLLMBenchOptions) -> list[torch.Tensor]:
    """vLLM's CPU caches ``[blocks, H, P, 2D]`` of one rank: two batches of blocks."""
    heads = opts.num_kv_heads // opts.tp_size
    shape = (2 * opts.batch_pages, heads, opts.page_size, 2 * opts.head_dim)
    return [torch.randn(shape).to(torch.bfloat16) for _ in range(opts.num_layers)]


def run_vllm_bench(opts: VLLMBenchOptions, log: Callable[[str], None] = print) -> list[Figure]:
    started = ensure_ray()
    store = f"bench-vllm-{os.getpid()}"
    model = ModelKV(
        num_layers=opts.num_layers,
        num_kv_heads=opts.num_kv_heads,
        head_dim=opts.head_dim,
        dtype="bfloat16",
    )
    kv = ShardKV(model=model, shard=Shard(tp_size=opts.tp_size), page_size=opts.page_size)
    storage = StorageConfig(
        backend="ray",
        model_id="bench/llama-3-8b",
        share_tp=opts.share_tp,
        ray=RayStorageOptions(name=store),
    )
    plan = plan_objects(kv, storage)
    mover = BlockMover(_caches(opts), "cpu_vec", plan, connect(storage, plan))
    raw = RawRay(RayStorageOptions().object_bytes)
    try:
        return _figures(opts, mover, raw, log)
    finally:
        mover.close()
        raw.clear()
        from actors.stores import drop_store

        drop_store(store)
        if started:
            import ray

            ray.shutdown()


class _RawBlocks:
    """The ceiling: the raw store moving the same objects between the same blocks, staged
    and placed as the connector stages and places them."""

    def __init__(self, mover: BlockMover, raw: RawRay, pages: int) -> None:
        self.mover, self.raw = mover, raw
        self.staging = mover.staging(pages)
        self.objects = mover.objects(self.staging)
        self.payloads = [byte_view(o) for o in self.objects]

    def put(self, names: list[str], blocks: list[int]) -> None:
        self.mover.gather(blocks, self.staging)
        self.raw.write(names, self.payloads)

    def stage(self, names: list[str]) -> None:
        self.raw.stage(names, self.payloads)

    def get(self, names: list[str], blocks: list[int]) -> None:
        for payload, obj in zip(self.raw.fetch(names), self.objects, strict=True):
            place = obj.view(torch.int16).numpy()  # bfloat16 has no numpy dtype
            np.copyto(place, payload.view(np.int16).reshape(place.shape))
        self.mover.place(self.staging, blocks)


def _figures(
    opts: VLLMBenchOptions, mover: BlockMover, raw: RawRay, log: Callable[[str], None]
) -> list[Figure]:
    n, p = opts.batch_pages, opts.page_size
    per_page = len(mover.plan.objects)
    nbytes = n * sum(o.num_bytes for o in mover.plan.objects)
    blocks_in, blocks_out = list(range(n)), list(range(n, 2 * n))
    placed = _RawBlocks(mover, raw, n)
    warm_object_store(8 * nbytes)
    log(
        f"storage vllm: {opts.repeats} x {n} blocks of {nbytes / n / 2**20:.2f} MiB "
        f"({per_page} objects each), vLLM CPU layout"
    )
    kinds = ("raw_put", "raw_get", "save", "save_foreground", "load")
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(opts.repeats + 1):  # repeat 0 warms up
        rec = samples if rep else {k: [] for k in samples}
        hashes = page_hashes(list(range(rep * n * p, (rep + 1) * n * p)), p)
        names = [f"{rep}-{i}" for i in range(n * per_page)]
        time_into(partial(placed.put, names, blocks_in), rec["raw_put"])
        _save(mover, hashes, blocks_in, rec)
        placed.stage(names)
        time_into(partial(placed.get, names, blocks_out), rec["raw_get"])
        time_into(partial(_load, mover, hashes, blocks_out), rec["load"])
        mover.backend.delete([k for h in hashes for k in mover.plan.keys(h)])
        raw.clear()
        # What was loaded is what was saved (outside the timings).
        if not all(torch.equal(c[blocks_in], c[blocks_out]) for c in mover.layers):
            raise RuntimeError("the connector loaded other bytes than it saved")
    return _rates(samples, nbytes)


def _save(
    mover: BlockMover, hashes: list[str], blocks: list[int], rec: dict[str, list[float]]
) -> None:
    """Save a batch; timed until the store holds its bytes (the shards own their copies,
    so they outlive the worker and reads see them), and, beside it, until the save's own
    future is done (the foreground only: the old figure)."""
    started = time.perf_counter()
    future = mover.save(PageJob("bench", hashes, blocks))
    if future is None or future.result() != len(hashes) * mover.page_size:
        raise RuntimeError("the connector did not save the whole batch; see the log")
    saved = time.perf_counter()
    mover.backend.flush()
    rec["save_foreground"].append(saved - started)
    rec["save"].append(time.perf_counter() - started)


def _load(mover: BlockMover, hashes: list[str], blocks: list[int]) -> None:
    if mover.load(PageJob("bench", hashes, blocks)):
        raise RuntimeError("the connector did not load the whole batch; see the log")


def _rates(samples: dict[str, list[float]], nbytes: int) -> list[Figure]:
    def gbps(key: str) -> float:
        return nbytes / statistics.median(samples[key]) / 1e9

    return [
        figure("storage.vllm.load.gbps", gbps("load"), "GB/s", ceiling=gbps("raw_get"), target=0.7),
        figure("storage.vllm.save.gbps", gbps("save"), "GB/s", ceiling=gbps("raw_put"), target=0.7),
        figure("storage.vllm.save_foreground.gbps", gbps("save_foreground"), "GB/s"),
    ]
