from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache_ray.cache.memory import DevicePool, HostPool
from tests.conftest import CPU, make_kv

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_page_bytes_round_trip_in_storage_order(layout: str, dtype: str) -> None:
    kv = make_kv(dtype=dtype)
    pool = HostPool(kv, 5, layout, layer_granule=2)  # type: ignore[arg-type]
    payload = np.random.default_rng(0).integers(0, 255, kv.page_bytes, dtype=np.uint8)
    pool.set_page_bytes(3, payload.tobytes())
    assert bytes(pool.get_page_bytes(3)) == payload.tobytes()
    # storage order is [layer, slot, token, head, dim]: check one element through page_rows
    elems = torch.from_numpy(payload.copy())  # raw bytes: random payloads hold NaNs
    shape = (kv.num_layers, kv.kv_slots, kv.page_size * kv.local_heads * kv.slot_dim)
    by_layer = elems.view(kv.dtype).view(shape)
    for layer in range(kv.num_layers):
        for slot in range(kv.kv_slots):
            got = pool.page_rows(layer, slot)[3].view(torch.uint8)
            assert torch.equal(got, by_layer[layer, slot].view(torch.uint8))
    assert not pool.get_page_bytes(2).tobytes().strip(b"\0")  # other pages untouched


def test_page_first_view_is_zero_copy() -> None:
    kv = make_kv()
    pool = HostPool(kv, 4, "page_first")
    view = pool.get_page_bytes(1)
    pool.page_rows(0, 0)[1].fill_(1.0)
    assert bytes(view[:4]) == np.float32(1.0).tobytes()


def test_set_page_bytes_rejects_wrong_size_and_accepts_read_only_buffers() -> None:
    kv = make_kv()
    pool = HostPool(kv, 2, "page_first")
    with pytest.raises(ValueError, match="expected"):
        pool.set_page_bytes(0, b"\0" * 7)
    ro = np.ones(kv.page_bytes, dtype=np.uint8)
    ro.flags.writeable = False
    pool.set_page_bytes(0, ro)
    assert bytes(pool.get_page_bytes(0)) == ro.tobytes()


def test_device_pool_shapes_and_indices() -> None:
    kv = make_kv(kv_lora_rank=6)
    pool = DevicePool(kv, 3, CPU)
    assert len(pool.buffers) == 1 and pool.layer(0)[0].shape == (12, 1, 6)
    assert pool.token_indices([2, 0]).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert pool.available_size == 12 and pool.size_bytes == 3 * kv.page_bytes
    assert pool.page_rows_bytes(0, 0).shape == (3, 4 * 6 * 4)


def test_object_reads_are_zero_copy_only_when_contiguous() -> None:
    kv = make_kv(num_layers=4, num_kv_heads=4)
    page_first = HostPool(kv, 4, "page_first")
    whole = page_first.read_object(1)
    assert whole.data_ptr() == page_first.buffers[0][1].data_ptr()
    part = page_first.read_object(1, (0, 2), (2, 4))  # a head slice is strided: copied
    assert part.is_contiguous() and part.shape == (2, 2, 4, 2, 8)
    direct = HostPool(kv, 4, "page_first_direct", layer_granule=2)
    assert direct.read_object(2, (2, 4)).data_ptr() == direct.buffers[1][2].data_ptr()


def test_object_writes_check_shape_and_bounds() -> None:
    kv = make_kv(num_layers=4, num_kv_heads=4)
    pool = HostPool(kv, 4, "layer_first")
    data = torch.arange(2 * 2 * 4 * 1 * 8, dtype=torch.float32).view(2, 2, 4, 1, 8)
    pool.write_object(3, data, (1, 3), (3, 4))
    assert torch.equal(pool.read_object(3, (1, 3), (3, 4)), data)
    assert not pool.read_object(3, (0, 1)).any()  # other layers untouched
    with pytest.raises(ValueError, match="expected"):
        pool.write_object(3, data, (0, 1), (3, 4))
    with pytest.raises(ValueError, match="outside"):
        pool.read_object(3, (0, 5))
    with pytest.raises(ValueError, match="page 4"):
        pool.read_object(4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_object_views_are_the_pools_own_bytes_of_that_object(layout: str) -> None:
    kv = make_kv(num_layers=4, num_kv_heads=4)
    pool = HostPool(kv, 5, layout, layer_granule=2)  # type: ignore[arg-type]
    for buf in pool.buffers:
        buf.copy_(torch.randn(buf.shape))
    for layers, heads in [(None, None), ((0, 2), (1, 3)), ((2, 4), (3, 4)), ((1, 3), None)]:
        for page in (0, 4):
            view = pool.object_view(page, layers, heads)
            if layout == "page_first_direct" and layers in (None, (1, 3)):  # spans groups
                assert view is None
                continue
            assert view is not None and torch.equal(view, pool.read_object(page, layers, heads))
            rows = pool.object_rows(layers, heads)  # every page's view of that object
            assert rows is not None and rows.shape[0] == 5 and torch.equal(rows[page], view)
            view.fill_(7.0)  # a read lands in the pool: read_object sees it
            assert bool((pool.read_object(page, layers, heads) == 7.0).all())
    with pytest.raises(ValueError, match="page 5"):
        pool.object_view(5, (0, 2))
    with pytest.raises(ValueError, match="outside"):
        pool.object_view(0, (0, 5))
