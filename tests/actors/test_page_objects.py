"""One stored page copied out of a Ray object (``copy_item``): the payload this store writes
(a byte array) is copied as it is; whatever else an object holds is read through a
memoryview, and a payload of the wrong size is a corrupt page, not a copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache_ray.base.views import byte_view
from hicache_ray.storage.page_format import CorruptPage, StridedOut, checksum, encode_header

page_objects = pytest.importorskip("actors.page_objects")


def _stored(payload: object, page: torch.Tensor) -> list[object]:
    return [encode_header("k", "ns", page, byte_view(page)), payload]


@pytest.mark.parametrize("kind", ["byte array", "bytes", "float array"])
def test_a_payload_of_any_buffer_kind_is_copied_and_hashed(kind: str) -> None:
    page = torch.randn(2, 3, 4)
    raw = bytes(byte_view(page))
    payload: object = {
        "byte array": np.frombuffer(raw, dtype=np.uint8),
        "bytes": raw,
        "float array": np.frombuffer(raw, dtype=np.float32),
    }[kind]
    out = torch.zeros(2, 3, 8)[:, :, :4]  # strided, as a page's place in a host pool
    outcome = page_objects.copy_item(_stored(payload, page), 0, StridedOut(out))
    assert isinstance(outcome, tuple) and outcome[1] == checksum(raw)
    assert torch.equal(out, page)


def test_a_payload_of_the_wrong_size_is_a_corrupt_page_and_nothing_is_copied() -> None:
    page = torch.randn(2, 3, 4)
    short = np.frombuffer(bytes(byte_view(page))[:-4], dtype=np.uint8)
    out = torch.zeros(2, 3, 4)
    outcome = page_objects.copy_item(_stored(short, page), 0, StridedOut(out))
    assert isinstance(outcome, CorruptPage) and "bytes, expected" in str(outcome)
    assert not out.any()
