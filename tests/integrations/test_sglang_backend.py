"""hicache-ray's L3 behind SGLang 0.5.23's storage interface, created by SGLang's factory.

Pages written by SGLang TP=2 ranks are read back byte for byte by TP=4 and TP=1 ranks, in
every host layout, through the zero-copy (v1) and the generic (flat page) paths; MLA pages
are written by TP rank 0 alone. Stores here are files (no Ray needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.utils import get_hash_str

from hicache_ray.base.errors import ConfigError
from tests.integrations.helpers import (
    HEADS,
    LAYERS,
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE,
    attach,
    expected,
    fill,
    host_pool,
    native_page,
    page_matches,
    storage_config,
)

TOKENS = list(range(500, 500 + 3 * PAGE))
HASHES = get_hash_str(TOKENS, None, page_size=PAGE)
HOST_PAGES = [5, 2, 9]  # where each page of TOKENS sits in every pool (not in order)


def _extra(root: Path, **more: Any) -> dict[str, Any]:
    return {"store": "file", "file": {"root": str(root)}, "share_tp": [1, 2, 4], **more}


def _page_tokens(i: int) -> list[int]:
    return TOKENS[i * PAGE : (i + 1) * PAGE]


def _heads(tp: int, rank: int) -> tuple[int, int]:
    local = HEADS // tp
    return rank * local, (rank + 1) * local


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def _write(backend: Any, pool: Any, v1: bool) -> bool:
    if v1:
        return all(backend.batch_set_v1(HASHES, _slots(HOST_PAGES)))
    flats = [pool.get_data_page(p * PAGE, flat=True) for p in HOST_PAGES]
    return bool(backend.batch_set(HASHES, flats))


def _read(backend: Any, pool: Any, v1: bool) -> int:
    """SGLang's controller flow for each path; returns the leading pages read."""
    if v1:
        results = backend.batch_get_v1(HASHES, _slots(HOST_PAGES))
        return results.index(False) if False in results else len(results)
    dummies = [pool.get_dummy_flat_data_page() for _ in HASHES]
    got = backend.batch_get(HASHES, dummies)
    count = 0
    for page, data in zip(HOST_PAGES, got, strict=True):
        if data is None:
            break
        pool.set_from_flat_data_page(page * PAGE, data)
        count += 1
    return count


def _tp_ranks(root: Path, tp: int, layout: str, v1: bool, **kw: Any) -> list[tuple[Any, Any]]:
    out = []
    for rank in range(tp):
        pool = host_pool(tp, layout, **kw)
        out.append((attach(storage_config(_extra(root), tp_rank=rank, tp=tp, v1=v1), pool), pool))
    return out


_CASES = [
    (writer, MHA_LAYOUTS[(i + 1) % len(MHA_LAYOUTS)], v1)
    for i, writer in enumerate(MHA_LAYOUTS)
    for v1 in (True, False)
    # SGLang's generic path has no flat page for page_unified (get_data_page refuses it)
    if v1 or "page_unified" not in (writer, MHA_LAYOUTS[(i + 1) % len(MHA_LAYOUTS)])
]


@pytest.mark.parametrize(("writer_layout", "reader_layout", "v1"), _CASES)
def test_tp2_writers_tp4_and_tp1_readers(
    tmp_path: Path, writer_layout: str, reader_layout: str, v1: bool
) -> None:
    for rank, (backend, pool) in enumerate(_tp_ranks(tmp_path, 2, writer_layout, v1)):
        for i, page in enumerate(HOST_PAGES):
            fill(pool, page, expected(_page_tokens(i), (0, LAYERS), _heads(2, rank)))
        assert _write(backend, pool, v1)
        backend.close()
    for tp in (4, 1):
        groups = {"head_groups": 2} if reader_layout == "page_unified" and tp == 1 else {}
        for rank, (backend, pool) in enumerate(
            _tp_ranks(tmp_path, tp, reader_layout, v1, **groups)
        ):
            assert backend.batch_exists(HASHES) == 3
            assert _read(backend, pool, v1) == 3, f"TP{tp} rank {rank}"
            for i, page in enumerate(HOST_PAGES):
                kv = expected(_page_tokens(i), (0, LAYERS), _heads(tp, rank))
                assert page_matches(pool, page, kv), f"TP{tp} rank {rank} page {i}"
            backend.close()


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_rank0_writes_every_rank_reads(tmp_path: Path, layout: str) -> None:
    ranks = []
    for rank in range(2):
        pool = host_pool(2, layout, mla=True, dtype=torch.bfloat16)
        config = storage_config(_extra(tmp_path), tp_rank=rank, tp=2, mla=True)
        ranks.append((attach(config, pool), pool))
    kvs = [expected(_page_tokens(i), (0, LAYERS), (0, 1), mla=True) % 256 for i in range(3)]
    (writer, writer_pool), (other, other_pool) = ranks
    assert other.batch_set_v1(HASHES, _slots(HOST_PAGES)) == [True] * 3  # stores nothing
    assert writer.batch_exists(HASHES) == 0 and other.storage_stats().put_pages == 0
    for page, kv in zip(HOST_PAGES, kvs, strict=True):
        fill(writer_pool, page, kv)
    assert writer.batch_set_v1(HASHES, _slots(HOST_PAGES)) == [True] * 3
    assert writer.storage_stats().put_pages == 3  # one object per page
    reader_pool = host_pool(1, layout, mla=True, dtype=torch.bfloat16)
    reader = attach(storage_config(_extra(tmp_path), mla=True), reader_pool)
    for backend, pool in ((other, other_pool), (reader, reader_pool)):
        assert backend.batch_get_v1(HASHES, _slots(HOST_PAGES)) == [True] * 3
        for page, kv in zip(HOST_PAGES, kvs, strict=True):
            assert page_matches(pool, page, kv)


def test_pp2_writers_pp1_reader(tmp_path: Path) -> None:
    """Stages of SGLang's split (``get_pp_indices``) on a shared layer grid."""
    extra = _extra(tmp_path, share_pp=[1, 2], num_layers=LAYERS)
    for stage, layers in enumerate(((0, 2), (2, 4))):
        pool = host_pool(1, "page_first", layers=layers)
        backend = attach(storage_config(extra, pp_rank=stage, pp=2), pool)
        assert [o.layers for o in backend.plan.objects] == [layers] * 4
        for i, page in enumerate(HOST_PAGES):
            fill(pool, page, expected(_page_tokens(i), layers, (0, HEADS)))
        assert backend.batch_set_v1(HASHES, _slots(HOST_PAGES)) == [True] * 3
    pool = host_pool(1, "layer_first")
    backend = attach(storage_config(extra), pool)
    assert backend.batch_get_v1(HASHES, _slots(HOST_PAGES)) == [True] * 3
    for i, page in enumerate(HOST_PAGES):
        assert page_matches(pool, page, expected(_page_tokens(i), (0, LAYERS), (0, HEADS)))


def test_leading_counts_and_idempotent_puts(tmp_path: Path) -> None:
    pool = host_pool(1, "page_first")
    backend = attach(storage_config(_extra(tmp_path)), pool)
    for i, page in enumerate(HOST_PAGES):
        fill(pool, page, expected(_page_tokens(i), (0, LAYERS), (0, HEADS)))
    assert backend.batch_set_v1(HASHES[:2], _slots(HOST_PAGES[:2])) == [True, True]
    assert backend.batch_exists(HASHES) == 2
    assert backend.batch_exists([HASHES[2], HASHES[0]]) == 0
    assert backend.exists(HASHES[1]) and not backend.exists(HASHES[2])
    stored = backend.storage_stats().put_bytes
    assert backend.batch_set_v1(HASHES, _slots(HOST_PAGES)) == [True] * 3  # two already there
    stats = backend.storage_stats()
    assert stats.put_skipped == 2 * 4 and stats.put_bytes == stored * 3 // 2
    assert backend.batch_get_v1([HASHES[0], "f" * 64, HASHES[1]], _slots(HOST_PAGES)) == [
        True,
        False,
        False,
    ]
    assert backend.get(HASHES[2], pool.get_dummy_flat_data_page()) is not None
    assert backend.get("e" * 64, pool.get_dummy_flat_data_page()) is None


def test_corrupt_object_is_a_miss_and_is_deleted(tmp_path: Path) -> None:
    pool = host_pool(1, "page_head")
    backend = attach(storage_config(_extra(tmp_path)), pool)
    for i, page in enumerate(HOST_PAGES):
        fill(pool, page, expected(_page_tokens(i), (0, LAYERS), (0, HEADS)))
    assert all(backend.batch_set_v1(HASHES, _slots(HOST_PAGES)))
    victim = next(tmp_path.rglob(f"{HASHES[1]}_*_H1*"))
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x40  # one bit of the payload
    victim.write_bytes(bytes(data))
    reader_pool = host_pool(1, "page_head")
    reader_pool.kv_buffer.fill_(1)
    reader = attach(storage_config(_extra(tmp_path)), reader_pool)
    assert reader.batch_get_v1(HASHES, _slots(HOST_PAGES)) == [True, False, False]
    # the batch ends in page 1 (its head group 1): nothing of page 2, which the store may
    # have read ahead, is left in the pool
    assert not native_page(reader_pool, HOST_PAGES[2]).any()
    assert reader.storage_stats().corrupt_pages == 1 and not victim.exists()
    assert reader.batch_exists(HASHES) == 1


def test_clear_drops_only_this_namespace(tmp_path: Path) -> None:
    pool = host_pool(1, "page_first")
    backend = attach(storage_config(_extra(tmp_path)), pool)
    other_pool = host_pool(1, "page_first")
    other = attach(storage_config(_extra(tmp_path), model="sgl/other-model"), other_pool)
    assert all(backend.batch_set_v1(HASHES, _slots(HOST_PAGES)))
    assert all(other.batch_set_v1(HASHES, _slots(HOST_PAGES)))
    backend.clear()
    assert backend.batch_exists(HASHES) == 0 and other.batch_exists(HASHES) == 3


def test_storage_metrics(tmp_path: Path) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = host_pool(1, "layer_first")
    backend = attach(storage_config(_extra(tmp_path)), pool)
    assert all(backend.batch_set_v1(HASHES, _slots(HOST_PAGES)))
    assert all(backend.batch_get_v1(HASHES[:2], _slots(HOST_PAGES[:2])))
    metrics = backend.get_stats()
    assert isinstance(metrics, StorageMetrics)
    assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [2]
    assert all(bw > 0 for bw in (*metrics.backup_bandwidth, *metrics.prefetch_bandwidth))
    assert backend.get_stats().prefetch_pgs == []  # drained


def test_bad_calls_are_refused(tmp_path: Path) -> None:
    pool = host_pool(1, "page_first")
    backend = attach(storage_config(_extra(tmp_path)), pool)
    with pytest.raises(ValueError, match="key grammar"):
        backend.batch_exists(["../../etc/passwd"])
    with pytest.raises(ValueError, match="whole pages"):
        backend.batch_get_v1(HASHES[:1], torch.arange(1, 1 + PAGE))
    with pytest.raises(ValueError, match="host slots"):
        backend.batch_set_v1(HASHES, _slots(HOST_PAGES[:2]))
    with pytest.raises(ValueError, match="whole pages"):
        backend.batch_get_v1(HASHES[:1], torch.arange(pool.size, pool.size + PAGE))
    with pytest.raises(ValueError, match=r"CPU torch\.float32"):
        backend.batch_set(HASHES[:1], [torch.zeros(10, dtype=torch.float16)])
    with pytest.raises(ValueError, match="flat page of"):
        backend.batch_set(HASHES[:1], [torch.zeros(10)])
    assert backend.storage_stats().put_pages == 0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"stor": "ray"}, "unknown field"),
        ({"store": "s3"}, "store"),
        ({"share_tp": [3]}, "share_tp"),
        ({"share_tp": "1,2"}, "share_tp"),
        ({"tenant_salt": "a"}, "cache_salt"),
        ({"ray": {"name": "a/b"}}, "plain name"),
        ({"num_layers": -1}, "num_layers"),
    ],
)
def test_bad_extra_config_is_refused(tmp_path: Path, extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        attach(storage_config({**_extra(tmp_path), **extra}), host_pool(1, "page_first"))


def test_keys_sglang_adds_on_its_own_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--file-storage-path`` makes SGLang add ``file_storage_path`` to every backend's
    extra_config: the backend starts, says it ignores the key, and stores where it was told."""
    extra = {**_extra(tmp_path), "file_storage_path": str(tmp_path / "sglang-files")}
    with caplog.at_level("INFO"):
        backend = attach(storage_config(extra), host_pool(1, "page_first"))
    assert "ignoring extra_config['file_storage_path']" in caplog.text
    assert all(backend.batch_set_v1(HASHES, _slots(HOST_PAGES)))
    assert not (tmp_path / "sglang-files").exists()


def test_no_model_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model_id"):
        attach(storage_config(_extra(tmp_path), model=None), host_pool(1, "page_first"))
