"""vLLM's own KV events as this library's cache events, for the cache index and router.

A vLLM engine publishes what its block pool gains and loses (``kv_events_config``: msgpack
``KVEventBatch`` payloads, one per scheduler step, numbered from 0). vLLM names blocks by
its own chained hashes, which no other engine shares; the L3 and the cache index name a
prompt's pages by the unified page hashes (:mod:`hicache_ray.keys.page_hash`). Each
``BlockStored`` carries its blocks' token ids and its parent's vLLM hash, so
:class:`VllmJournal` names its blocks as the connector names their L3 pages: the chain
continues from the parent's page hash, or, for a prompt's first block, starts from the
request's ``cache_salt`` (vLLM publishes it in the first block's ``extra_keys``) or the
connector's tenant salt. It keeps vLLM hash -> page hash for the last ``max_blocks``
blocks named (a function of the content: never wrong, only forgotten).

A block it cannot name is left out (counted in ``unnamed``): its parent was forgotten or
never heard of (the journal started late), it was made under a LoRA adapter or with
multimodal or embedding inputs (the connector's page names hold tokens only), its block
size is not the page size, or it belongs to another KV cache group. Leaving a block out
costs the router a guess, never a wrong answer.

The connector's own saves come as ``BlockStored`` events of medium ``STORAGE`` (the
scheduler side publishes a page once every TP worker stored its objects), already named by
page hashes: they become ``L3`` events (:data:`~hicache_ray.cache.events.STORE_MEDIUM`),
which the index keeps for the whole application.

The journal then serves subscribers as a deployment's own journal does
(:meth:`cache_events`, :meth:`cache_snapshot`, the same :class:`~hicache_ray.cache.events.
EventBatch`): its pages per medium (vLLM's ``GPU``: the engine's KV cache, L1 to the
index; ``CPU``: vLLM's own offloading, L2). A vLLM batch that does not follow the last one
(:meth:`take` returns False) and cannot be replayed is a gap: :meth:`restart` forgets what
the engine held, and the next batch begins with ``AllBlocksCleared``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import msgspec

from hicache_ray.cache.events import (
    STORE_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    KVEventBatch,
    kept_since,
)
from hicache_ray.keys import page_hashes

__all__ = ["VllmJournal"]

_L1 = "GPU"
_STORAGE = "STORAGE"  # vLLM's medium of a connector's store


class _Stored(msgspec.Struct, tag="BlockStored"):
    """vLLM's ``BlockStored`` (the fields read; later ones are ignored)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_decode = msgspec.msgpack.Decoder(_Batch).decode


class VllmJournal:
    """One vLLM engine's cache events, named by page hashes (see the module docstring).

    Args:
        page_size: tokens per page (the engine's block size).
        salt: the connector's tenant salt (for requests without a ``cache_salt``).
        keep_batches: batches kept for subscribers that fall behind.
        max_blocks: vLLM hashes remembered (to name the blocks that follow them).
        clock: wall-clock seconds (the batches' ``ts``).
    """

    def __init__(
        self,
        page_size: int,
        salt: str = "",
        *,
        keep_batches: int = 256,
        max_blocks: int = 1 << 20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if type(page_size) is not int or page_size <= 0:
            raise ValueError(f"page_size must be an int > 0, got {page_size!r}")
        if type(max_blocks) is not int or max_blocks <= 0:
            raise ValueError(f"max_blocks must be an int > 0, got {max_blocks!r}")
        self.page_size, self.salt = page_size, salt
        self.epoch = uuid.uuid4().hex
        self.seq = 0  # of the last batch kept
        self.last_vllm_seq = -1  # of the last vLLM batch taken (they start at 0)
        self.unnamed = 0  # blocks left out
        self.gaps = 0  # restarts
        self._clock = clock
        self._names: OrderedDict[int | bytes, str] = OrderedDict()
        self._max_blocks = max_blocks
        self._held: dict[str, set[str]] = {}
        self._kept: deque[EventBatch] = deque(maxlen=keep_batches)
        self._pending: list[Event] = [AllBlocksCleared()]
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)

    def take(self, vllm_seq: int, payload: bytes) -> bool:
        """Apply vLLM's batch ``vllm_seq``; False (nothing applied) when it does not follow
        the last one taken. A payload that does not decode is a gap (:meth:`restart`)."""
        with self._lock:
            if vllm_seq <= self.last_vllm_seq:
                return True  # already taken (a replay overlapping the live stream)
            if vllm_seq != self.last_vllm_seq + 1:
                return False
            try:
                batch = _decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._restart(vllm_seq)
                return True
            for event in batch.events:
                self._play(event)
            self.last_vllm_seq = vllm_seq
            self._flush(batch.ts)
            self._changed.notify_all()
            return True

    def restart(self, vllm_seq: int) -> None:
        """Batches before ``vllm_seq`` are lost: forget what the engine held, and go on
        from ``vllm_seq``."""
        with self._lock:
            self._restart(vllm_seq - 1)

    def cache_events(self, epoch: str, seq: int, wait_s: float = 0.0) -> list[EventBatch] | None:
        """The batches after ``seq`` of journal ``epoch``; None when they are not all kept
        (or ``epoch`` is not this journal): the subscriber takes :meth:`cache_snapshot`.
        It answers at once (``wait_s`` is for a journal in another process: there an
        answer is a call, here a lock)."""
        del wait_s
        with self._lock:
            return kept_since(self._kept, self.seq, seq) if epoch == self.epoch else None

    def cache_snapshot(self) -> EventBatch:
        """Everything the engine holds, as one batch numbered with the last one kept."""
        with self._lock:
            events: list[Event] = [AllBlocksCleared()]
            for medium, pages in self._held.items():
                if pages:
                    events.append(BlockStored(sorted(pages), None, [], 0, medium=medium))
            return EventBatch(self.epoch, self.seq, KVEventBatch(self._clock(), events))

    def held(self, medium: str = _L1) -> set[str]:
        """The page hashes the engine holds in ``medium`` (a copy)."""
        with self._lock:
            return set(self._held.get(medium, ()))

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until ``predicate`` holds after a batch is taken;
        ``predicate`` may read the journal (:meth:`held`). Returns whether it holds."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def _restart(self, last: int) -> None:
        self.gaps += 1
        self._held.clear()
        self._pending = [AllBlocksCleared()]
        self.last_vllm_seq = last
        self._flush(self._clock())
        self._changed.notify_all()

    def _flush(self, ts: float) -> None:
        if self._pending:
            self.seq += 1
            self._kept.append(EventBatch(self.epoch, self.seq, KVEventBatch(ts, self._pending)))
            self._pending = []

    def _play(self, event: _Stored | _Removed | _Cleared) -> None:
        if isinstance(event, _Cleared):
            self._held.clear()
            self._pending.append(AllBlocksCleared())
        elif event.group_idx:
            return  # another KV cache group (hybrid models): not the connector's pages
        elif isinstance(event, _Stored):
            self._stored(event)
        else:
            medium = event.medium or _L1
            pages = [p for p in map(self._names.get, event.block_hashes) if p is not None]
            if pages:
                self._held.setdefault(medium, set()).difference_update(pages)
                self._pending.append(BlockRemoved(pages, medium))

    def _stored(self, event: _Stored) -> None:
        if event.medium == _STORAGE:  # the connector's saves, named by page hashes
            saved = [h.hex() for h in event.block_hashes if isinstance(h, bytes) and len(h) == 32]
            self._pending.append(BlockStored(saved, None, [], self.page_size, medium=STORE_MEDIUM))
            return
        pages = self._name(event)
        if pages is None:
            self.unnamed += len(event.block_hashes)
            return
        medium = event.medium or _L1
        self._held.setdefault(medium, set()).update(pages)
        before = event.parent_block_hash
        parent = None if before is None else self._names.get(before)
        self._pending.append(BlockStored(pages, parent, [], self.page_size, medium=medium))

    def _name(self, event: _Stored) -> list[str] | None:
        """The page hashes of ``event``'s blocks (remembered), or None: not nameable."""
        n, p = len(event.block_hashes), self.page_size
        if event.block_size != p or len(event.token_ids) != n * p or event.lora_name:
            return None
        keys = event.extra_keys or []
        if any(k and not (i == 0 and _salt_only(k)) for i, k in enumerate(keys)):
            return None  # multimodal or embedding inputs: not in the page names
        if event.parent_block_hash is None:
            salt = keys[0][0] if keys and keys[0] else self.salt
            pages = page_hashes(event.token_ids, p, salt=salt or None)
        else:
            parent = self._names.get(event.parent_block_hash)
            if parent is None:
                return None
            pages = page_hashes(event.token_ids, p, prior=bytes.fromhex(parent))
        names = self._names
        for block, page in zip(event.block_hashes, pages, strict=True):
            names[block] = page
            names.move_to_end(block)
        while len(names) > self._max_blocks:
            names.popitem(last=False)
        return pages


def _salt_only(keys: list[Any]) -> bool:
    """A first block's extra keys that hold only the request's ``cache_salt``."""
    return len(keys) == 1 and isinstance(keys[0], str)
