from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hicache_ray.base.errors import TransferError
from hicache_ray.base.layout import ShardKV
from hicache_ray.cache.memory import DevicePool, HostPool, TransferEngine, page_runs
from tests.conftest import CPU, make_kv

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def test_page_runs_groups_pairs_consecutive_on_both_sides() -> None:
    assert page_runs([], []) == []
    assert page_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    assert page_runs([1, 2, 3], [5, 6, 7]) == [(1, 5, 3)]
    with pytest.raises(ValueError, match="source pages"):
        page_runs([1], [])


def _fill(pool: DevicePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for slot in pool.buffers:
        for t in slot:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("mla", [False, True])
def test_write_then_load_round_trips_scattered_pages(layout: str, workers: int, mla: bool) -> None:
    kv = make_kv(kv_lora_rank=8 if mla else 0)
    dev, host = DevicePool(kv, 8, CPU), HostPool(kv, 12, layout, layer_granule=2)  # type: ignore[arg-type]
    _fill(dev, 0)
    before = [[t.clone() for t in slot] for slot in dev.buffers]
    with TransferEngine(dev, host, workers) as engine:
        src, dst = [5, 0, 1, 2, 7], [3, 4, 5, 11, 0]
        w = engine.write(src, dst)
        w.wait(timeout=10)
        assert w.ok and w.num_bytes == 5 * kv.page_bytes and w.latency_s is not None
        for slot in dev.buffers:
            for t in slot:
                t.zero_()
        back = [6, 2, 3, 4, 1]
        engine.load(dst, back).wait(timeout=10)
    for s, slot in enumerate(dev.buffers):
        for layer, t in enumerate(slot):
            rows, ref = t.view(8, -1), before[s][layer].view(8, -1)
            for a, b in zip(src, back, strict=True):
                assert torch.equal(rows[b], ref[a])


def test_layer_counter_and_fifo_completion() -> None:
    kv = make_kv(num_layers=4)
    dev, host = DevicePool(kv, 4, CPU), HostPool(kv, 8, "layer_first")
    with TransferEngine(dev, host) as engine:
        transfers = [engine.write([i], [i]) for i in range(4)]
        transfers[-1].wait_until(0, timeout=10)
        transfers[-1].wait(timeout=10)
        assert all(t.done for t in transfers)  # FIFO: earlier ones finished first
        assert transfers[-1].layers_done == 4
        empty = engine.load([], [])
        assert empty.done and empty.ok


class _FailingHost(HostPool):
    """A host pool whose layer ``fail_layer`` cannot be read or written."""

    fail_layer = 1

    def page_rows_bytes(self, layer: int, slot: int) -> np.ndarray:
        if layer == self.fail_layer:
            raise OSError("injected copy failure")
        return super().page_rows_bytes(layer, slot)


def test_failed_copy_reaches_waiters_and_engine_keeps_working() -> None:
    kv = make_kv(num_layers=3)
    dev, host = DevicePool(kv, 4, CPU), _FailingHost(kv, 8, "page_first")
    with TransferEngine(dev, host) as engine:
        t = engine.load([0, 1], [0, 1])
        with pytest.raises(TransferError, match="injected copy failure"):
            t.wait(timeout=10)
        assert t.done and not t.ok
        host.fail_layer = 99
        ok = engine.load([0], [2])
        ok.wait(timeout=10)
        assert ok.ok


def test_wait_timeout_and_closed_engine() -> None:
    kv: ShardKV = make_kv()
    dev, host = DevicePool(kv, 4, CPU), HostPool(kv, 8)
    gate = threading.Event()

    class _Slow(HostPool):
        def page_rows_bytes(self, layer: int, slot: int) -> np.ndarray:
            gate.wait(10)
            return super().page_rows_bytes(layer, slot)

    slow = TransferEngine(dev, _Slow(kv, 8), num_workers=1)
    t = slow.write([0], [0])
    with pytest.raises(TransferError, match="not in after"):
        t.wait(timeout=0.01)
    gate.set()
    t.wait(timeout=10)
    slow.close()
    slow.close()  # idempotent
    with pytest.raises(TransferError, match="closed"):
        slow.write([0], [0])
    TransferEngine(dev, host).close()


def test_mismatched_pools_are_refused() -> None:
    with pytest.raises(ValueError, match="different KV shapes"):
        TransferEngine(DevicePool(make_kv(), 2, CPU), HostPool(make_kv(head_dim=16), 4))
