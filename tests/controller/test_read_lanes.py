"""Prefetch reads in lanes: a batch's pages, split over threads, count as one read would."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import pairwise

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_ray.cache.controller import reads
from hicache_ray.cache.controller.reads import leading
from hicache_ray.keys import page_hashes
from hicache_ray.storage import MemoryObjects
from hicache_ray.storage.objects import PageCheck, ReadOutcome, SizeOutcome
from hicache_ray.storage.page_format import ReadOut
from tests.conftest import make_kv
from tests.controller.helpers import (
    PAGE,
    controller_config,
    drain,
    make_controller,
    prompt,
    stored,
)
from tests.controller.helpers import run_request as run

KV = make_kv(page_size=PAGE)


class FailingPages(MemoryObjects):
    """Reads stop at the objects of chosen pages (by page hash, whichever thread asks),
    and the names of the threads that read are kept."""

    def __init__(self) -> None:
        super().__init__()
        self.failing: set[str] = set()
        self.readers: set[str] = set()

    def read_many(self, keys: Sequence[str], outs: Sequence[ReadOut]) -> list[ReadOutcome]:
        self.readers.add(threading.current_thread().name)
        for i, key in enumerate(keys):
            if key.split("_")[0] in self.failing:
                found = super().read_many(keys[:i], outs[:i])
                return [*found, OSError("injected")] if len(found) == i else found
        return super().read_many(keys, outs)


@pytest.mark.parametrize(
    ("threads", "failing", "expected"),
    [(2, None, 10), (2, 2, 2), (2, 7, 7), (3, 4, 4), (3, 8, 8), (1, 6, 6)],
    ids=["whole", "first-lane", "second-lane", "3-middle-lane", "3-last-lane", "one-lane"],
)
def test_lanes_read_the_leading_pages_exactly(
    monkeypatch: pytest.MonkeyPatch, threads: int, failing: int | None, expected: int
) -> None:
    monkeypatch.setattr(reads, "LANE_MIN_BYTES", 1)  # the test's tiny pages are split too
    objects = FailingPages()
    tokens = prompt(21, 10 * PAGE)
    stored(objects, tokens)
    if failing is not None:
        objects.failing.add(page_hashes(tokens, PAGE)[failing])
    config = controller_config(batch_size_pages=10)
    storage = msgspec.structs.replace(config.storage, read_threads=threads)
    config = msgspec.structs.replace(config, storage=storage)
    reader = make_controller(config, KV, objects)
    objects.readers.clear()
    cached, _ = run(reader, "r", tokens)  # checks the KV of every cached page
    assert cached == expected
    lanes = {name for name in objects.readers if name.startswith("hicache-prefetch-lane")}
    # the first lane is the read thread itself; the pool may serve two lanes on one thread
    assert (1 <= len(lanes) <= threads - 1) if threads > 1 else not lanes
    if failing is not None:
        assert reader.stats().unfulfilled_tokens["read_failed"] == (10 - expected) * PAGE
    drain(reader)
    reader.check_integrity()
    reader.close()


@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 5)), min_size=1, max_size=6))
def test_leading_counts_as_one_sequential_read(lanes: list[tuple[int, int]]) -> None:
    sizes = [size for size, _ in lanes]
    counts = [min(size, done) for size, done in lanes]
    cuts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    ok = [i < cuts[k] + counts[k] for k in range(len(sizes)) for i in range(cuts[k], cuts[k + 1])]
    sequential = next((i for i, good in enumerate(ok) if not good), len(ok))
    assert leading(list(pairwise(cuts)), counts) == sequential


class CountingObjects(MemoryObjects):
    """Counts the keys of each lookup and read call; ``parallel``: a store that copies one
    read on threads of its own (as the ray store does)."""

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.reads_in_parallel = parallel
        self.lookups: list[int] = []
        self.reads: list[int] = []

    def size_many(self, keys: Sequence[str], leading: bool = True) -> list[SizeOutcome]:
        if leading:
            self.lookups.append(len(keys))
        return super().size_many(keys, leading)

    def read_many(
        self, keys: Sequence[str], outs: Sequence[ReadOut], check: PageCheck | None = None
    ) -> list[ReadOutcome]:
        self.reads.append(len(keys))
        return super().read_many(keys, outs)  # the backend verifies what is not checked


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-store", "serial-store"])
def test_an_l3_hit_costs_few_store_calls(parallel: bool) -> None:
    """The query asks every page in one lookup; a store that reads in parallel is read in
    one call (every call is a round trip on the hit's critical path), another in batches."""
    objects = CountingObjects(parallel)
    tokens = prompt(22, 20 * PAGE)
    stored(objects, tokens)
    reader = make_controller(controller_config(batch_size_pages=4), KV, objects)
    objects.lookups.clear()
    cached, _ = run(reader, "r", tokens)  # checks the KV of every cached page
    assert cached == 20
    per_page = len(reader.plan.objects)
    assert objects.lookups == [20 * per_page]
    assert objects.reads == ([20 * per_page] if parallel else [4 * per_page] * 5)
    drain(reader)
    reader.check_integrity()
    reader.close()
