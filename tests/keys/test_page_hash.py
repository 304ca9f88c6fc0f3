from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hicache_ray.keys import page_hashes, salt_seed

# docs/storage.md, "Page hash": SGLang's page hash, page size 4.
VECTOR_1 = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
VECTOR_2 = "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"


def test_sglang_test_vectors_hold() -> None:
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == [VECTOR_1, VECTOR_2]


def test_partial_last_page_gets_no_hash() -> None:
    assert page_hashes([1, 2, 3, 4, 5, 6, 7], 4) == [VECTOR_1]
    assert page_hashes([1, 2, 3], 4) == []


def test_every_input_form_hashes_alike() -> None:
    tokens = list(range(100, 116))
    expected = page_hashes(tokens, 8)
    assert page_hashes(np.array(tokens, dtype=np.int64), 8) == expected
    assert page_hashes(bytes(np.array(tokens, dtype="<u4")), 8) == expected


def test_continuing_a_chain_equals_hashing_at_once() -> None:
    tokens = list(range(64))
    whole = page_hashes(tokens, 16)
    head = page_hashes(tokens[:32], 16)
    tail = page_hashes(tokens[32:], 16, prior=bytes.fromhex(head[-1]))
    assert head + tail == whole


def test_tenant_salts_give_disjoint_keys() -> None:
    tokens = list(range(4096))
    plain = page_hashes(tokens, 64)
    a = page_hashes(tokens, 64, salt="tenant-a")
    b = page_hashes(tokens, 64, salt=b"tenant-b")
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert salt_seed(None) == salt_seed("") == b""


def test_the_salt_seed_is_sglangs_storage_namespace_seed() -> None:
    # sglang.srt.mem_cache.utils.storage_namespace_seed(None, "tenant-a"), spelled out
    import hashlib

    h = hashlib.sha256(b"sglang-cache-namespace-v1")
    h.update(b"\x00" + b"\x01" + (8).to_bytes(8, "little") + b"tenant-a")
    assert salt_seed("tenant-a") == h.digest()
    assert page_hashes([1, 2, 3, 4], 4, salt="tenant-a") == page_hashes(
        [1, 2, 3, 4], 4, prior=h.digest()
    )


def test_prefix_sharing_pages_share_hashes_and_a_change_breaks_the_chain() -> None:
    base = list(range(256))
    changed = base.copy()
    changed[70] += 1  # page 1 of 64-token pages
    h1, h2 = page_hashes(base, 64), page_hashes(changed, 64)
    assert h1[0] == h2[0] and all(x != y for x, y in zip(h1[1:], h2[1:], strict=True))


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        page_hashes([-1, 2], 2)


_CHILD = (
    "from hicache_ray.keys import page_hashes; "
    "print(','.join(page_hashes(list(range(1000)), 64) + page_hashes([7]*128, 64, salt='t')))"
)


def test_same_hashes_in_fresh_processes_whatever_pythonhashseed() -> None:
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(run.stdout.strip())
    assert outputs[0] == outputs[1]
    assert outputs[0].split(",")[:15] == page_hashes(list(range(1000)), 64)
