"""The storage contract, run against every object store (memory, local files, S3, the Ray
object store), each also behind the fault injector."""

from __future__ import annotations

import threading

import pytest
import torch

from hicache_ray.base.storage_config import Fault
from hicache_ray.base.views import byte_view
from hicache_ray.storage import FaultyObjects
from hicache_ray.storage.page_format import encode_header
from tests.storage.conftest import (
    BACKENDS,
    empty_buffers,
    make_pages,
    make_plan,
    page_keys,
    stored_size,
)

pytestmark = pytest.mark.parametrize("object_store_factory", BACKENDS, indirect=True)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_round_trip(backend_factory) -> None:
    backend = backend_factory()
    plan = backend.plan
    keys, pages = page_keys(plan, 5), make_pages(plan, 5)
    assert backend.exists(keys) == 0
    assert backend.put(keys, pages) == 5
    assert backend.exists(keys) == 5
    out = empty_buffers(plan, 5)
    assert backend.get(keys, out) == 5
    assert _equal(out, pages)
    stats = backend.stats()
    assert (stats.put_pages, stats.get_pages, stats.num_objects) == (5, 5, 5)
    assert stats.get_bytes == 5 * pages[0].numel() * 2
    backend.check_integrity()


def test_counts_are_of_leading_keys(backend_factory) -> None:
    backend = backend_factory()
    plan = backend.plan
    keys, pages = page_keys(plan, 4), make_pages(plan, 4)
    assert backend.put([keys[0], keys[1], keys[3]], [pages[0], pages[1], pages[3]]) == 3
    assert backend.exists(keys) == 2
    assert backend.get(keys, empty_buffers(plan, 4)) == 2
    assert backend.exists(keys[2:]) == 0
    assert backend.exists(keys[3:]) == 1


def test_exists_each_answers_every_key_and_the_put_after_it_stores_the_rest(
    backend_factory,
) -> None:
    backend = backend_factory()
    plan = backend.plan
    keys, pages = page_keys(plan, 5), make_pages(plan, 5)
    assert backend.put([keys[1], keys[3]], [pages[1], pages[3]]) == 2
    assert backend.exists_each(keys) == [False, True, False, True, False]
    absent = [0, 2, 4]
    assert backend.put([keys[i] for i in absent], [pages[i] for i in absent]) == 3
    assert backend.exists(keys) == 5
    out = empty_buffers(plan, 5)
    assert backend.get(keys, out) == 5 and _equal(out, pages)
    with pytest.raises(ValueError):
        backend.exists_each(["../escape"])


def test_put_of_a_present_key_is_not_rewritten(backend_factory) -> None:
    backend = backend_factory()
    plan = backend.plan
    keys, pages = page_keys(plan, 3), make_pages(plan, 3)
    backend.put(keys, pages)
    assert backend.put(keys, make_pages(plan, 3, seed=9)) == 3  # different bytes, same names
    stats = backend.stats()
    assert (stats.put_pages, stats.put_skipped, stats.num_objects) == (3, 3, 3)
    out = empty_buffers(plan, 3)
    assert backend.get(keys, out) == 3 and _equal(out, pages)


def test_capacity_evicts_least_recently_used(backend_factory) -> None:
    plan = make_plan()
    probe = backend_factory(plan, capacity_bytes=0)
    probe.put(page_keys(plan, 1, seed=7), make_pages(plan, 1))
    one = probe.stats().stored_bytes
    backend = backend_factory(plan, capacity_bytes=3 * one, scan_on_start=False)
    keys, pages = page_keys(plan, 5), make_pages(plan, 5)
    assert backend.put(keys[:3], pages[:3]) == 3
    assert backend.get(keys[:1], empty_buffers(plan, 1)) == 1  # key 0 is now most recent
    assert backend.put(keys[3:], pages[3:]) == 2  # evicts keys 1 and 2
    assert [backend.exists([k]) for k in keys] == [1, 0, 0, 1, 1]
    stats = backend.stats()
    assert stats.evicted_pages == 2 and stats.stored_bytes <= 3 * one
    backend.check_integrity()


def test_a_page_larger_than_the_capacity_is_refused(backend_factory) -> None:
    backend = backend_factory(capacity_bytes=100)
    plan = backend.plan
    assert backend.put(page_keys(plan, 1), make_pages(plan, 1)) == 0
    assert backend.stats().put_failures == 1
    backend.check_integrity()


def test_a_put_larger_than_the_capacity_says_what_did_not_fit(backend_factory, caplog) -> None:
    plan = make_plan()
    probe = backend_factory(plan, capacity_bytes=0)
    probe.put(page_keys(plan, 1, seed=7), make_pages(plan, 1))
    one = probe.stats().stored_bytes
    backend = backend_factory(plan, capacity_bytes=3 * one + one // 2, scan_on_start=False)
    with caplog.at_level("WARNING"):
        assert backend.put(page_keys(plan, 5), make_pages(plan, 5)) == 3
    assert (
        f"page 4 of a 5-page put ({one} bytes) does not fit capacity_bytes={3 * one + one // 2} "
        f"next to the {3 * one} bytes of the pages before it" in caplog.text
    )
    assert "it and the 1 after it are not stored" in caplog.text
    backend.check_integrity()


def test_concurrent_writers_of_the_same_keys(backend_factory) -> None:
    backend = backend_factory()
    plan = backend.plan
    keys, pages = page_keys(plan, 6), make_pages(plan, 6)
    start = threading.Barrier(4)
    results: list[int] = []

    def writer() -> None:
        start.wait(timeout=30)
        results.append(backend.put(keys, pages))

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [6, 6, 6, 6]
    out = empty_buffers(plan, 6)
    assert backend.get(keys, out) == 6 and _equal(out, pages)
    assert backend.stats().num_objects == 6
    backend.check_integrity()


@pytest.mark.parametrize("kind", ["corrupt", "truncate"])
def test_damaged_objects_are_detected_deleted_and_counted(
    backend_factory, object_store_factory, kind
) -> None:
    plan = make_plan()
    objects = FaultyObjects(
        object_store_factory(), (Fault(op="write", kind=kind, skip=1, limit=1),)
    )
    backend = backend_factory(plan, objects=objects)
    keys, pages = page_keys(plan, 3), make_pages(plan, 3)
    assert backend.put(keys, pages) == 3  # the second object is stored damaged
    out = empty_buffers(plan, 3)
    assert backend.get(keys, out) == 1
    assert torch.equal(out[0], pages[0])
    assert backend.stats().corrupt_pages == 1
    assert stored_size(objects.inner, keys[1]) is None  # deleted
    assert backend.exists(keys) == 1
    backend.check_integrity()


def test_foreign_namespace_pages_are_misses_and_deleted(backend_factory, object_store_factory):
    objects = object_store_factory()
    ours, theirs = make_plan(), make_plan(model_id="other/model")
    keys = page_keys(ours, 2)
    # a page stored under our key by a writer of another namespace (a mis-configured peer,
    # or a store shared with a different build): its header names their digest
    pages = make_pages(ours, 2)
    payloads = [byte_view(p) for p in pages]
    headers = [
        encode_header(k, theirs.digest, p, v) for k, p, v in zip(keys, pages, payloads, strict=True)
    ]
    assert objects.write_many(keys, headers, payloads) == [None, None]
    backend = backend_factory(ours, objects=objects)
    assert backend.get(keys, empty_buffers(ours, 2)) == 0
    assert backend.stats().corrupt_pages == 1
    assert stored_size(objects, keys[0]) is None


def _wrong_buffers(shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Buffers a misconfigured peer might pass for an fp16 ``shape`` object."""
    layer_short = (shape[0] - 1, *shape[1:]) if shape[0] > 1 else (*shape[:-1], shape[-1] - 1)
    return [
        torch.empty(shape, dtype=torch.float32),
        torch.empty(shape, dtype=torch.bfloat16),
        torch.empty(layer_short, dtype=torch.float16),
        torch.empty(tuple(reversed(shape)), dtype=torch.float16),
    ]


def _strided(shape: tuple[int, ...], fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A strided view of ``shape`` (every other element of its base) and the base."""
    base = torch.full((*shape[:-1], shape[-1] * 2), fill, dtype=torch.float16)
    return base[..., ::2], base


def test_reads_fill_strided_buffers_in_place(backend_factory) -> None:
    """A buffer may be an object's place in a pool laid out otherwise: it is filled in
    one pass, and nothing around it is touched."""
    backend = backend_factory()
    plan = backend.plan
    keys, pages = page_keys(plan, 2), make_pages(plan, 2)
    assert backend.put(keys, pages) == 2
    views, bases = zip(*(_strided(o.shape, 7.0) for o in (plan.objects[0],) * 2), strict=True)
    assert backend.get(keys, list(views)) == 2 and _equal(list(views), pages)
    assert all(bool((base[..., 1::2] == 7.0).all()) for base in bases)
    with pytest.raises(ValueError, match="strided"):
        backend.put(page_keys(plan, 1, seed=1), [_strided(plan.objects[0].shape, 0.0)[0]])


def test_a_callers_wrong_buffer_is_an_error_and_never_deletes_a_page(backend_factory) -> None:
    backend = backend_factory()
    plan = backend.plan
    keys, pages = page_keys(plan, 2), make_pages(plan, 2)
    backend.put(keys, pages)
    for i, wrong in enumerate(_wrong_buffers(plan.objects[0].shape)):
        with pytest.raises(ValueError, match="expected"):
            backend.get(keys, [empty_buffers(plan, 1)[0], wrong])
        assert backend.stats().refused_pages == i + 1
    with pytest.raises(ValueError, match="not one of this rank"):
        backend.get(["f" * 64 + "_someone-else"], empty_buffers(plan, 1))
    stats = backend.stats()
    assert stats.corrupt_pages == 0 and stats.get_pages == 0
    out = empty_buffers(plan, 2)
    assert backend.get(keys, out) == 2 and _equal(out, pages)  # nothing was deleted


def test_a_bad_page_is_refused_and_cannot_poison_its_key(backend_factory) -> None:
    backend = backend_factory()
    plan = backend.plan
    keys, pages = page_keys(plan, 1), make_pages(plan, 1)
    with pytest.raises(ValueError, match=r"expected torch\.float16"):
        backend.put(keys, [pages[0].float()])  # a float32 page under an fp16 plan
    assert backend.exists(keys) == 0 and backend.stats().refused_pages == 1
    assert backend.put(keys, pages) == 1  # the correct page is stored, not skipped
    out = empty_buffers(plan, 1)
    assert backend.get(keys, out) == 1 and _equal(out, pages)


@pytest.mark.parametrize("bad", ["../../victim", b"a" * 64, 7, None, "a" * 64 + "/x"])
def test_keys_outside_the_grammar_are_refused_before_any_io(backend_factory, bad) -> None:
    backend = backend_factory()
    plan = backend.plan
    good = page_keys(plan, 1)
    for call in (
        lambda: backend.exists([*good, bad]),
        lambda: backend.get([*good, bad], empty_buffers(plan, 2)),
        lambda: backend.put([*good, bad], make_pages(plan, 2)),
        lambda: backend.delete([bad]),
    ):
        with pytest.raises(ValueError, match="key"):
            call()
    assert backend.exists(good) == 0  # nothing of the batch was stored


def test_a_rejected_page_leaves_no_unverified_bytes_in_its_buffer(
    backend_factory, object_store_factory
) -> None:
    plan = make_plan()
    objects = FaultyObjects(object_store_factory(), (Fault(op="read", kind="corrupt", skip=1),))
    backend = backend_factory(plan, objects=objects)
    keys, pages = page_keys(plan, 3), make_pages(plan, 3)
    backend.put(keys, pages)
    out = empty_buffers(plan, 3)  # filled with -1
    assert backend.get(keys, out) == 1
    assert torch.equal(out[0], pages[0])
    assert not out[1].any()  # the corrupt page's bytes were zeroed, not left in the buffer
    assert all(not b.any() or bool((b == -1).all()) for b in out[2:])  # zeroed or untouched


def test_metadata_cache_expires_after_its_ttl(backend_factory, object_store_factory) -> None:
    now = [0.0]
    objects = object_store_factory()
    backend = backend_factory(objects=objects, metadata_ttl_s=5.0, clock=lambda: now[0])
    plan = backend.plan
    keys = page_keys(plan, 2)
    backend.put(keys, make_pages(plan, 2))
    objects.remove_many(keys[1:])  # another process deletes a page behind our back
    now[0] = 4.9
    assert backend.exists(keys) == 2  # trusted from the cache
    now[0] = 5.1
    assert backend.exists(keys) == 1
    backend.check_integrity()


def test_restart_scans_this_namespace_only(backend_factory, object_store_factory) -> None:
    plan, other = make_plan(), make_plan(model_id="other/model")
    keys, pages = page_keys(plan, 4), make_pages(plan, 4)
    backend_factory(plan).put(keys, pages)
    backend_factory(other).put(page_keys(other, 3, seed=5), make_pages(other, 3))
    # Lookups that reach the store fail from now on: only the scan can know the pages.
    blind = FaultyObjects(object_store_factory(), (Fault(op="size", kind="fail"),))
    restarted = backend_factory(plan, objects=blind)
    stats = restarted.stats()
    assert stats.num_objects == 4
    assert restarted.exists(keys) == 4
    out = empty_buffers(plan, 4)
    assert restarted.get(keys, out) == 4 and _equal(out, pages)


def test_delete(backend_factory) -> None:
    backend = backend_factory()
    plan = backend.plan
    keys = page_keys(plan, 3)
    backend.put(keys, make_pages(plan, 3))
    backend.delete([*keys[1:], "0" * 64 + "_absent"])
    assert backend.exists(keys) == 1 and backend.stats().num_objects == 1
    backend.check_integrity()


def _damage(objects, plan, keys: list[str], pages: list[torch.Tensor], at: int, kind: str) -> None:
    """Replace the stored object of ``keys[at]``: removed, a payload byte flipped, the
    payload truncated, or the object of the next page stored under its name."""
    objects.remove_many([keys[at]])
    if kind == "missing":
        return
    src = (at + 1) % len(keys) if kind == "swapped" else at
    payload = bytearray(byte_view(pages[src]))
    header = encode_header(keys[src], plan.digest, pages[src], byte_view(pages[src]))
    if kind == "flipped":
        payload[-1] ^= 0x01
    elif kind == "truncated":
        payload = payload[:-3]
    assert objects.write_many([keys[at]], [header], [memoryview(payload)]) == [None]


@pytest.mark.parametrize("kind", ["missing", "flipped", "truncated", "swapped"])
@pytest.mark.parametrize("num_keys", [4, 12])
def test_nothing_past_the_count_holds_stored_bytes(
    backend_factory, object_store_factory, kind: str, num_keys: int
) -> None:
    """A bad object at any position of a batch (a flipped one right after it) ends the
    batch there, and every buffer from it on is zero-filled: read-ahead and in-flight
    reads leave no bytes behind."""
    objects = object_store_factory()
    plan = make_plan()
    for at in range(num_keys):
        keys, pages = page_keys(plan, num_keys, seed=at + 1), make_pages(plan, num_keys, seed=at)
        backend = backend_factory(plan, objects=objects, scan_on_start=False)
        assert backend.put(keys, pages) == num_keys
        store = getattr(objects, "inner", objects)
        _damage(store, plan, keys, pages, at, kind)
        if at + 1 < num_keys:
            _damage(store, plan, keys, pages, at + 1, "flipped")
        out = empty_buffers(plan, num_keys)  # filled with -1
        assert backend.get(keys, out) == at, f"damaged at {at}"
        assert _equal(out[:at], pages[:at]), f"damaged at {at}"
        assert all(not b.any() for b in out[at:]), f"bytes left past {at}"


def test_a_backup_looks_each_new_page_up_once(backend_factory, object_store_factory) -> None:
    """The backup path (``exists``, then ``put`` of what is missing) does not ask again
    about the page ``exists`` saw absent; a present page is still never rewritten, and a
    later ``exists`` still asks (absence is never cached for reads)."""
    asked: list[list[str]] = []  # the keys of each lookup call

    class Counting(FaultyObjects):
        def size_many(self, keys, leading=True):
            asked.append(list(keys))
            return super().size_many(keys, leading)

    plan = make_plan()
    backend = backend_factory(plan, objects=Counting(object_store_factory(), ()))
    keys, pages = page_keys(plan, 6), make_pages(plan, 6)
    assert backend.put(keys[:2], pages[:2]) == 2
    asked.clear()
    present = backend.exists(keys)
    assert present == 2
    assert len(asked) == 1  # the lookup of exists
    assert backend.put(keys[present:], pages[present:]) == 4
    assert all(keys[2] not in call for call in asked[1:])  # seen absent: not asked again
    # out of order: keys after an absent one are not taken as absent (key 0 is stored)
    assert backend.exists([keys[0]]) == 1
    assert backend.exists([page_keys(plan, 1, seed=5)[0], keys[0]]) == 0
    assert backend.put(keys[:1], pages[:1]) == 1 and backend.stats().put_skipped >= 1
    asked.clear()
    assert backend.exists(keys) == 6 and not asked  # just written: known present
