"""Storage fixtures: a plan to name pages, page builders, and backends over every store.

The S3 store is a moto server on 127.0.0.1 (an ephemeral port) started once per session and
stopped at the end; each test gets its own key prefix.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import pytest
import torch

from hicache_ray.base.config import CacheConfig, MemoryConfig
from hicache_ray.base.layout import ModelKV, Shard, ShardKV
from hicache_ray.base.storage_config import Fault, RayStorageOptions, StorageConfig
from hicache_ray.keys import ShardPlan, page_hashes, plan_shard
from hicache_ray.storage import (
    FaultyObjects,
    FileObjects,
    MemoryObjects,
    ObjectStore,
    PagedBackend,
)

# Every store, and each again behind the fault injector with a rule that never fires (the
# production I/O path through the injector: one store call per batch).
STORES = ("memory", "file", "file-s3", "ray")
BACKENDS = (*STORES, *(f"{kind}+faults" for kind in STORES))


def make_plan(*, model_id: str = "test/model", share_tp: tuple[int, ...] = (1, 2)) -> ShardPlan:
    model = ModelKV(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16")
    kv = ShardKV(model=model, shard=Shard(), page_size=4)
    config = CacheConfig(
        memory=MemoryConfig(page_size=4, device_tokens=64),
        storage=StorageConfig(backend="memory", model_id=model_id, share_tp=share_tp),
    )
    return plan_shard(kv, config)


def page_keys(plan: ShardPlan, num_pages: int, seed: int = 0) -> list[str]:
    """One key per page (the plan's first object) of a prompt made from ``seed``."""
    tokens = [seed * 100_000 + i for i in range(num_pages * 4)]
    return [plan.keys(h)[0] for h in page_hashes(tokens, 4)]


def make_pages(plan: ShardPlan, num_pages: int, seed: int = 0) -> list[torch.Tensor]:
    shape = plan.objects[0].shape
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.float16) for _ in range(num_pages)]


def empty_buffers(plan: ShardPlan, num_pages: int) -> list[torch.Tensor]:
    return [torch.full(plan.objects[0].shape, -1.0, dtype=torch.float16) for _ in range(num_pages)]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"{host}:{port}"
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1")
    client.create_bucket(Bucket="pages")
    try:
        yield endpoint
    finally:
        server.stop()


_prefixes = itertools.count()


@pytest.fixture
def object_store_factory(request, tmp_path) -> Callable[[], ObjectStore]:
    """Opens the same underlying store again on every call (a restarted process)."""
    kind, _, faulty = request.param.partition("+")
    opened = _opener(request, tmp_path, kind)
    if not faulty:
        return opened
    inert = (Fault(op="read", kind="delay", delay_s=0.0, probability=0.0),)
    return lambda: FaultyObjects(opened(), inert)


def _opener(request, tmp_path, kind: str) -> Callable[[], ObjectStore]:
    if kind == "memory":
        shared = MemoryObjects()
        return lambda: shared
    if kind == "ray":
        from actors.ray_store import RayObjects
        from actors.stores import clear_store

        # One store for the whole suite (its shard actors start once), emptied around
        # every test and dropped at the end of the session.
        options = request.getfixturevalue("contract_store")
        clear_store(options)
        request.addfinalizer(lambda: clear_store(options))
        return lambda: RayObjects(options)
    if kind == "file":
        return lambda: FileObjects(str(tmp_path / "l3"))
    endpoint = request.getfixturevalue("s3_endpoint")
    uri = f"s3://pages/t{next(_prefixes)}?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    return lambda: FileObjects(uri)


@pytest.fixture(scope="session")
def contract_store() -> Iterator[RayStorageOptions]:
    from tests.helpers import ensure_local_ray

    ensure_local_ray()
    options = RayStorageOptions(name="contract", num_shards=2)
    yield options
    from actors.stores import drop_store

    ensure_local_ray()
    drop_store(options.name)


BackendFactory = Callable[..., PagedBackend]


@pytest.fixture
def backend_factory(object_store_factory) -> BackendFactory:
    def make(plan: ShardPlan | None = None, objects: ObjectStore | None = None, **kwargs):
        return PagedBackend(
            "test", objects or object_store_factory(), plan or make_plan(), **kwargs
        )

    return make


def stored_size(objects: ObjectStore, key: str) -> int | None:
    """What the store itself says of ``key`` (None: absent)."""
    answer = objects.size_many([key])[0]
    assert not isinstance(answer, Exception), answer
    return answer
