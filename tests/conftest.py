"""Builders shared by the suites (keyword-only defaults) and the environment every test needs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache_ray.base.config import CacheConfig, MemoryConfig, WriteConfig
from hicache_ray.base.layout import ModelKV, Shard, ShardKV
from tests.helpers import ensure_local_ray

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
torch.set_num_threads(2)

CPU = torch.device("cpu")


@pytest.fixture
def ray_local() -> Iterator[None]:
    """A local Ray shared by every test that asks for it; started on first use (again
    after a module that ran its own cluster) and shut down at the end of the session."""
    pytest.importorskip("ray")
    ensure_local_ray()
    yield


@pytest.fixture(scope="session", autouse=True)
def _shut_ray_down() -> Iterator[None]:
    """Shut the shared Ray down at the end, after checking that every test dropped the L3
    stores it made (a store left behind would live on in a real cluster)."""
    yield
    import sys

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        from actors.stores import drop_store, list_stores

        left = [s.name for s in list_stores(timeout_s=5)]
        for name in left:
            drop_store(name)
        sys.modules["ray"].shutdown()
        assert not left, f"tests left L3 stores alive: {left}"


def make_kv(
    *,
    num_layers: int = 3,
    num_kv_heads: int = 4,
    head_dim: int = 8,
    dtype: str = "float32",
    page_size: int = 4,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    kv_lora_rank: int = 0,
) -> ShardKV:
    model = ModelKV(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,  # type: ignore[arg-type]
        kv_lora_rank=kv_lora_rank,
    )
    shard = Shard(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
    return ShardKV(model=model, shard=shard, page_size=page_size)


def make_config(
    *,
    page_size: int = 4,
    device_tokens: int = 64,
    hicache_ratio: float = 2.0,
    mem_layout: str = "page_first",
    io_backend: str | None = None,
    write_policy: str = "write_through",
    hit_threshold: int = 0,
) -> CacheConfig:
    if io_backend is None:
        io_backend = "direct" if mem_layout == "page_first_direct" else "kernel"
    return CacheConfig(
        memory=MemoryConfig(
            page_size=page_size,
            device_tokens=device_tokens,
            hicache_ratio=hicache_ratio,
            mem_layout=mem_layout,  # type: ignore[arg-type]
            io_backend=io_backend,  # type: ignore[arg-type]
            layer_granule=2,
        ),
        write=WriteConfig(policy=write_policy, hit_threshold=hit_threshold),  # type: ignore[arg-type]
    )


@pytest.fixture
def kv() -> ShardKV:
    return make_kv()


_TESTS = Path(__file__).resolve().parent
# Tests of these folders need a Ray cluster (or start one through the CLI) or SGLang.
_RAY_FOLDERS = {"actors", "apps", "examples"}
_RAY_MODULES = {"test_groups.py", "test_sglang_deployment.py"}


def _needs_ray(item: pytest.Item) -> bool:
    rel = Path(str(item.fspath)).resolve().relative_to(_TESTS)
    if rel.parts[0] in _RAY_FOLDERS or rel.name in _RAY_MODULES:
        return True
    if {"ray_local", "contract_store"} & set(getattr(item, "fixturenames", ())):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(str(v).partition("+")[0] == "ray" for v in params.values())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Lanes: tests that need Ray are marked ``ray``, those of SGLang ``sglang`` (``make
    test-fast`` leaves both out). Tests marked ``gpu`` need CUDA: skipped (with the reason)
    on machines without it."""
    for item in items:
        if _needs_ray(item):
            item.add_marker(pytest.mark.ray)
        if Path(str(item.fspath)).resolve().relative_to(_TESTS).parts[0] == "integrations":
            item.add_marker(pytest.mark.sglang)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check runs these on a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_EXIT: list[int] = []  # the session's exit status, once it has finished


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the test process here, with the session's exit status, once pytest has reported
    and every exit handler has run (Ray's shutdown, the benches' clean-ups). Twice (Dec 3
    and Dec 5) the interpreter's own teardown that follows crashed with a segmentation
    fault after every test had passed, with no stack (the fault handler is gone by then),
    and failed ``make test``: native threads (Ray's, gRPC's, torch's) torn down with the
    interpreter. ``HICACHE_TESTS_FULL_EXIT=1`` keeps the normal exit, to look for it."""
    if not _EXIT or os.environ.get("HICACHE_TESTS_FULL_EXIT") == "1":
        return
    import atexit
    import sys

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT[0])
