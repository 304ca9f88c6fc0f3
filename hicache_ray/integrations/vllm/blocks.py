"""The vLLM connector's worker side without vLLM: pages between the store and vLLM's blocks.

Pages are staged ``[pages, G, L, S, P, Hg, D]`` (G head groups of Hg heads: the stored
objects' head grid), so every object of a staged page (a layer chunk of one head group) is
one contiguous slice that the store reads into and writes from in place. Saves gather
whole blocks (``index_select``, a block-sized copy each) and reorder them into staging
with one strided copy per layer and slot; loads reorder staging into whole blocks the same
way and scatter them (``index_copy_``). No copy is per token or per page.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hicache_ray.base.stats import ConnectorStats
from hicache_ray.integrations.vllm.pages import PageJob
from hicache_ray.integrations.vllm.setup import slot_views
from hicache_ray.keys import ShardPlan
from hicache_ray.storage import PagedBackend

__all__ = ["BlockMover", "LayerByLayer"]

log = logging.getLogger(__name__)


_SPARE_BUFFERS = 4  # staging buffers kept for reuse


def _nothing() -> None:
    pass


def _head_group(plan: ShardPlan, heads: int) -> int:
    """Heads per stored object (every object of a rank spans the same number)."""
    sizes = {hb - ha for ha, hb in (o.local_heads for o in plan.objects)}
    size = sizes.pop()
    if sizes or heads % size:
        raise ValueError(f"objects of {sorted(sizes | {size})} heads do not tile {heads} heads")
    return size


class BlockMover:
    """Worker-side page moves between the store and vLLM's paged KV (one per worker).

    Args:
        layers: this worker's attention layers' caches, in layer order.
        layout: a :data:`~hicache_ray.integrations.vllm.setup.BLOCK_LAYOUTS` name.
        plan: this rank's objects per page.
        backend: the store.
        max_pending_saves: saves queued behind the store before new ones are dropped.
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        layout: str,
        plan: ShardPlan,
        backend: PagedBackend,
        max_pending_saves: int = 64,
    ) -> None:
        first = layers[0]
        self.layers = list(layers)
        self._layout = layout
        self._heads, self._head_dim = int(first.shape[1]), int(first.shape[3]) // 2
        for t in self.layers:  # checks every layer's shape
            slot_views(layout, t, self._heads, self._head_dim)
        self.page_size = int(first.shape[2])
        size = _head_group(plan, self._heads)
        self._groups = self._heads // size
        self._page_shape = (
            self._groups,
            len(layers),
            2,
            self.page_size,
            size,
            self._head_dim,
        )
        self._dtype, self._device = first.dtype, first.device
        self.plan, self.backend = plan, backend
        self._max_pending = max_pending_saves
        self._pending = 0
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-vllm-save")
        self._spare: list[torch.Tensor] = []  # staging given back by loads and saves
        self._saved: list[str] = []  # guarded by _lock: pages stored since take_saved
        self.counts = ConnectorStats()

    # ------------------------------------------------------------ staging

    def staging(self, pages: int) -> torch.Tensor:
        """New room for ``pages`` pages (pinned when the caches are on CUDA)."""
        shape = (pages, *self._page_shape)
        return torch.empty(shape, dtype=self._dtype, pin_memory=self._device.type == "cuda")

    def _buffer(self, pages: int) -> torch.Tensor:
        """Staging for one load or save, from the buffers earlier moves gave back when one
        is large enough (fresh memory costs a page fault per 4 KiB, several times the copy)."""
        with self._lock:
            for i, buf in enumerate(self._spare):
                if buf.shape[0] >= pages:
                    return self._spare.pop(i)[:pages]
        return self.staging(pages)

    def give_back(self, staging: torch.Tensor) -> None:
        """Return staging from :meth:`read` (or a save) for reuse."""
        base = staging._base if staging._base is not None else staging
        with self._lock:
            if len(self._spare) < _SPARE_BUFFERS:
                self._spare.append(base)

    def objects(self, staging: torch.Tensor) -> list[torch.Tensor]:
        """Every object of every staged page, in key order (contiguous views)."""
        size = self._page_shape[4]
        out = []
        for i in range(staging.shape[0]):
            for obj in self.plan.objects:
                (la, lb), (ha, _) = obj.local_layers, obj.local_heads
                out.append(staging[i, ha // size, la:lb])
        return out

    def _grouped(self, view: torch.Tensor) -> torch.Tensor:
        """A ``[n, P, H, D]`` slot view as ``[n, G, P, Hg, D]``."""
        n, page, _, dim = view.shape
        size = self._page_shape[4]
        return view.view(n, page, self._groups, size, dim).permute(0, 2, 1, 3, 4)

    def gather(self, block_ids: Sequence[int], staging: torch.Tensor) -> None:
        """Copy the blocks' KV into ``staging`` (one page per block, in order)."""
        index = torch.tensor(list(block_ids), device=self._device)
        for layer, cache in enumerate(self.layers):
            blocks = cache.index_select(0, index).to("cpu")
            for slot, view in enumerate(slot_views(self._layout, blocks, *self._kv())):
                staging[:, :, layer, slot].copy_(self._grouped(view))

    def place(
        self, staging: torch.Tensor, block_ids: Sequence[int], layers: Sequence[int] | None = None
    ) -> None:
        """Write the staged pages into the blocks (one page per block, in order), in
        ``layers`` (default: every layer)."""
        n = staging.shape[0]
        index = torch.tensor(list(block_ids), device=self._device)
        blocks = torch.empty((n, *self.layers[0].shape[1:]), dtype=self._dtype)
        for layer in range(len(self.layers)) if layers is None else layers:
            for slot, view in enumerate(slot_views(self._layout, blocks, *self._kv())):
                self._grouped(view).copy_(staging[:, :, layer, slot])
            self.layers[layer].index_copy_(0, index, blocks.to(self._device, non_blocking=True))

    def _kv(self) -> tuple[int, int]:
        return self._heads, self._head_dim

    def _keys(self, hashes: Sequence[str]) -> list[str]:
        return [key for h in hashes for key in self.plan.keys(h)]

    # ------------------------------------------------------------ moves

    @torch.inference_mode()
    def load(self, job: PageJob) -> list[int]:
        """Read the job's pages and place them in its blocks; returns the blocks whose
        pages could not be read and verified (vLLM recomputes them). Loads and saves run in
        inference mode wherever they are called from (vLLM's step, a loader thread): the
        staging they pass on to each other is an inference tensor either way."""
        staging, done = self.read(job)
        if done:
            self.place(staging[:done], job.block_ids[:done])
        self.give_back(staging)
        return job.block_ids[done:]

    @torch.inference_mode()
    def read(self, job: PageJob) -> tuple[torch.Tensor, int]:
        """Read and verify the job's pages into staging (give it back once placed); returns
        it and how many leading pages it holds (the blocks of the rest are load errors)."""
        staging = self._buffer(len(job.hashes))
        per_page = len(self.plan.objects)
        done = 0
        if job.hashes:
            done = self.backend.get(self._keys(job.hashes), self.objects(staging)) // per_page
        with self._lock:
            self.counts.loaded_tokens += done * self.page_size
            self.counts.load_failed_tokens += (len(job.hashes) - done) * self.page_size
        return staging, done

    @torch.inference_mode()
    def save(self, job: PageJob) -> Future[int] | None:
        """Copy the job's blocks out now and store them in the background (the blocks are
        free once this returns); None when the save was dropped (queue full)."""
        tokens = len(job.hashes) * self.page_size
        with self._lock:
            if self._pending >= self._max_pending:
                self.counts.save_dropped_tokens += tokens
                return None
            self._pending += 1
        staging = self._buffer(len(job.hashes))
        self.gather(job.block_ids, staging)
        return self._writer.submit(self._store, job.hashes, staging, tokens)

    def take_saved(self) -> list[str]:
        """The page hashes whose objects of this worker were stored since the last call."""
        with self._lock:
            saved, self._saved = self._saved, []
        return saved

    def _store(self, hashes: list[str], staging: torch.Tensor, tokens: int) -> int:
        keys = self._keys(hashes)
        per_page = len(self.plan.objects)
        try:
            # NOTE: vLLM computed these pages because the scheduler's lookup missed them
            # (or they follow a miss): asking the store again costs a round trip per save
            # to learn what is almost always no; a concurrent writer's copy is harmless.
            pages = self.backend.put(keys, self.objects(staging), unseen=True) // per_page
            stored = pages * self.page_size
        except Exception as exc:  # a failed save is a later miss, never a failed request
            log.warning("hicache-ray vLLM connector: a save failed: %s", exc)
            pages = stored = 0
        self.give_back(staging)
        with self._lock:
            self._saved.extend(hashes[:pages])
            self._pending -= 1
            self.counts.saved_tokens += stored
            self.counts.save_dropped_tokens += tokens - stored
        return stored

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every save queued so far is stored, failed or dropped."""
        self._writer.submit(_nothing).result(timeout_s)

    def close(self) -> None:
        """Finish the queued saves, then close the store client."""
        self._writer.shutdown(wait=True)
        self.backend.flush()
        self.backend.close()


class LayerByLayer:
    """One step's in-step loads, placed layer by layer on the loader thread while the
    forward runs: the attention of layer i waits (:meth:`wait`) for layer i alone, so the
    placing of later layers overlaps the forward of earlier ones. Every page is read and
    verified before the first layer is placed (an object holds all of a page's layers).

    Args:
        mover: the worker's block mover.
        jobs: the step's loads.
    """

    def __init__(self, mover: BlockMover, jobs: Sequence[PageJob]) -> None:
        self._mover, self._jobs = mover, list(jobs)
        self._ready = [threading.Event() for _ in mover.layers]
        self.failed: list[int] = []  # blocks not loaded (complete once the last layer is)

    @torch.inference_mode()
    def run(self) -> None:
        """On the loader thread: read every job, then place layer after layer."""
        reads: list[tuple[PageJob, torch.Tensor, int]] = []
        try:
            for job in self._jobs:
                reads.append((job, *self._mover.read(job)))
            for job, _, done in reads:
                self.failed += job.block_ids[done:]
            for layer, ready in enumerate(self._ready):
                for job, staging, done in reads:
                    if done:
                        self._mover.place(staging[:done], job.block_ids[:done], [layer])
                ready.set()
        except Exception as exc:  # a failed load is a recompute, never a failed request
            log.warning("hicache-ray vLLM connector: a load failed: %s", exc)
            self.failed = [b for job in self._jobs for b in job.block_ids]
        finally:
            for _, staging, _ in reads:
                self._mover.give_back(staging)
            for ready in self._ready:
                ready.set()

    def wait(self, layer: int) -> None:
        """Until ``layer``'s blocks are placed (or the load failed)."""
        self._ready[layer].wait()

    def wait_all(self) -> list[int]:
        """Until every layer is placed; the blocks not loaded."""
        self._ready[-1].wait()
        return self.failed
