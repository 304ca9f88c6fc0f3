from __future__ import annotations

import msgspec
import pytest
import torch

from hicache_ray.base.config import (
    CacheConfig,
    MemoryConfig,
    PrefetchConfig,
    SchedulerConfig,
    WriteConfig,
    compatible_io_backends,
)
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.layout import ModelKV, Shard, ShardKV, host_pool_pages
from hicache_ray.base.storage_config import StorageConfig
from tests.conftest import make_config, make_kv

BAD_MEMORY = [
    ({"page_size": 0}, "page_size"),
    ({"page_size": 48}, "power of two"),
    ({"device_tokens": -5}, "device_tokens"),
    ({"device_tokens": 32, "page_size": 64}, "smaller than one page"),
    ({"hicache_ratio": 0}, "hicache_ratio"),
    ({"hicache_size_bytes": -1}, "hicache_size_bytes"),
    ({"mem_layout": "token_first"}, "mem_layout"),
    ({"io_backend": "gds"}, "io_backend"),
    ({"mem_layout": "page_first", "io_backend": "direct"}, "cannot move pages"),
    ({"mem_layout": "page_first_direct", "io_backend": "kernel"}, "cannot move pages"),
    ({"layer_granule": -1}, "layer_granule"),
]


@pytest.mark.parametrize(("kwargs", "needle"), BAD_MEMORY)
def test_bad_memory_config_names_field_and_fix(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        MemoryConfig(**kwargs)  # type: ignore[arg-type]
    assert needle in str(err.value)
    assert ";" in str(err.value)  # problem; fix


@pytest.mark.parametrize(
    ("factory", "kwargs", "needle"),
    [
        (WriteConfig, {"policy": "write_around"}, "write_policy"),
        (WriteConfig, {"hit_threshold": -1}, "hit_threshold"),
        (PrefetchConfig, {"policy": "eager"}, "prefetch_policy"),
        (PrefetchConfig, {"threshold_tokens": -1}, "prefetch_threshold"),
        (PrefetchConfig, {"timeout_base_s": -1.0}, "timeout_base_s"),
        (PrefetchConfig, {"timeout_cap_s": 0.0}, "timeout_cap_s"),
        (PrefetchConfig, {"max_host_fraction": 1.5}, "max_host_fraction"),
        (StorageConfig, {"batch_size_pages": 0}, "storage_batch_size"),
        (StorageConfig, {"read_threads": 0}, "storage_read_threads"),
        (StorageConfig, {"read_threads": 65}, "storage_read_threads"),
        (StorageConfig, {"key_scheme": "flat"}, "key_scheme"),
        (SchedulerConfig, {"hold_siblings": "yes"}, r"scheduler\.hold_siblings"),
        (SchedulerConfig, {"hold_siblings": 1}, r"scheduler\.hold_siblings"),
        (SchedulerConfig, {"max_step_tokens": 0}, r"scheduler\.max_step_tokens"),
    ],
)
def test_bad_other_configs(factory: type, kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        factory(**kwargs)


def test_write_through_refuses_host_not_larger_than_device() -> None:
    with pytest.raises(ConfigError, match="no room for L3 hits"):
        CacheConfig(memory=MemoryConfig(hicache_ratio=1.0))
    # write_back may run with a small host pool
    CacheConfig(memory=MemoryConfig(hicache_ratio=0.5), write=WriteConfig(policy="write_back"))


def test_host_pool_pages_checks_bytes_and_budget() -> None:
    kv = make_kv()
    config = make_config(device_tokens=64)
    assert host_pool_pages(config, kv) == 32
    sized = msgspec.structs.replace(
        config, memory=msgspec.structs.replace(config.memory, hicache_size_bytes=kv.page_bytes * 8)
    )
    with pytest.raises(ConfigError, match="no room for L3 hits"):
        host_pool_pages(sized, kv)
    with pytest.raises(ConfigError, match="budget"):
        host_pool_pages(config, kv, budget_bytes=kv.page_bytes * 10)
    with pytest.raises(ConfigError, match="no room for one page"):
        host_pool_pages(config, kv, budget_bytes=1)


def test_defaults_match_design() -> None:
    c = CacheConfig()
    assert c.memory.page_size == 64 and c.memory.hicache_ratio == 2.0
    assert c.write.policy == "write_through" and c.write.effective_threshold == 1
    assert WriteConfig(policy="write_through_selective").effective_threshold == 2
    # design.md's 256-token floor gave way to the recompute guard's measured rule (issue 42:
    # a lookup for every admitted request whose prefix L3 holds, unless computing is faster)
    assert c.prefetch.policy == "timeout" and c.prefetch.threshold_tokens == 0
    assert c.prefetch.recompute_guard
    assert c.prefetch.timeout_s(1024) == pytest.approx(2.1)
    assert c.prefetch.timeout_s(10**9) == 30.0
    assert c.storage.batch_size_pages == 128 and c.storage.key_scheme == "unified"
    assert compatible_io_backends("layer_first") == ("kernel", "direct")


def test_config_round_trips_through_msgpack() -> None:
    c = make_config(write_policy="write_back", hicache_ratio=0.5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=CacheConfig) == c


def test_shard_facts() -> None:
    kv = make_kv(num_layers=7, num_kv_heads=8, tp_rank=1, tp_size=4, pp_rank=1, pp_size=3)
    assert kv.local_heads == 2 and kv.first_head == 2
    assert kv.layer_range == (2, 4)  # 7 layers over 3 stages: 2, 2, 3 (SGLang's split)
    assert kv.shard.rank == 5 and kv.shard.world_size == 12
    mla = make_kv(kv_lora_rank=16, tp_size=2, tp_rank=1)
    assert mla.kv_slots == 1 and mla.local_heads == 1 and mla.slot_dim == 16
    assert kv.page_bytes == kv.num_layers * 2 * 4 * 2 * 8 * 4


@pytest.mark.parametrize(
    ("model", "shard", "needle"),
    [
        ({"num_kv_heads": 6}, {"tp_size": 4}, "does not divide num_kv_heads"),
        ({"num_layers": 2}, {"pp_size": 3, "pp_rank": 0}, "more stages"),
    ],
)
def test_bad_shards(model: dict[str, int], shard: dict[str, int], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ShardKV(
            model=ModelKV(**{"num_layers": 4, "num_kv_heads": 4, "head_dim": 8, **model}),
            shard=Shard(**shard),
            page_size=4,
        )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"pp_rank": -1}, "pp_rank"),
    ],
)
def test_bad_shard_coordinates(kwargs: dict[str, int], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Shard(**kwargs)


def test_bad_model() -> None:
    with pytest.raises(ConfigError, match="num_layers"):
        ModelKV(num_layers=0, num_kv_heads=1, head_dim=1)
    with pytest.raises(ConfigError, match="dtype"):
        ModelKV(num_layers=1, num_kv_heads=1, head_dim=1, dtype="int4")  # type: ignore[arg-type]


def test_config_errors_survive_pickling() -> None:
    import pickle

    err = ConfigError("page_size", 0, "must be positive", "set it above 0")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ConfigError and str(back) == str(err) and back.field == "page_size"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"name": "a b"}, "ray.name"),
        ({"num_shards": -1}, "ray.num_shards"),
        ({"capacity_bytes": -1}, "ray.capacity_bytes"),
        ({"object_bytes": 0}, "ray.object_bytes"),
        ({"timeout_s": 0.0}, "ray.timeout_s"),
        ({"address": 5}, "ray.address"),
        ({"address": None}, "ray.address"),
    ],
)
def test_bad_ray_storage_options(kwargs: dict[str, object], needle: str) -> None:
    from hicache_ray.base.storage_config import RayStorageOptions

    with pytest.raises(ConfigError, match=needle):
        RayStorageOptions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"name": "x y"}, "name"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": 3}, "does not divide"),
        ({"pp_size": 9}, "exceeds"),
        ({"idle_step_s": 60.0}, "idle_step_s"),
        ({"max_retries": -1}, "max_retries"),
    ],
)
def test_bad_deployment_configs(kwargs: dict[str, object], needle: str) -> None:
    spec = pytest.importorskip("hicache_ray.engine.spec")
    with pytest.raises(ConfigError, match=needle):
        spec.DeploymentConfig(**kwargs)


# Every invalid setting the deployment-edge review found: (factory, kwargs, field named).
def _deployment(**kwargs: object) -> object:
    spec = pytest.importorskip("hicache_ray.engine.spec")
    return spec.DeploymentConfig(**kwargs)


def _storage_deployment(**storage: object) -> object:
    from hicache_ray.engine.model import ModelConfig

    model = ModelConfig(num_heads=4, num_kv_heads=4)
    cache = CacheConfig(storage=StorageConfig(backend="memory", model_id="m", **storage))
    return _deployment(model=model, tp_size=2, cache=cache)


EDGE_CASES = [
    (_deployment, {"collective_timeout_s": -1.0}, "collective_timeout_s"),
    (_deployment, {"placement_timeout_s": -1.0}, "placement_timeout_s"),
    (_deployment, {"consensus_timeout_s": -1.0}, "consensus_timeout_s"),
    (_deployment, {"consensus_timeout_s": float("nan")}, "consensus_timeout_s"),
    (_deployment, {"cpus_per_rank": -1.0}, "cpus_per_rank"),
    (_deployment, {"cpus_per_rank": 0.0}, "cpus_per_rank"),
    (_deployment, {"gpus_per_rank": -1}, "gpus_per_rank"),
    (_deployment, {"host_budget_bytes": -1}, "host_budget_bytes"),
    (_deployment, {"bundle_resources": {"CPU": -1.0}}, "bundle_resources"),
    (_deployment, {"bundle_resources": {"pool": -1.0}}, "bundle_resources['pool']"),
    (_deployment, {"tp_size": 2.0}, "tp_size"),
    (_deployment, {"max_retries": 1.5}, "max_retries"),
    (_deployment, {"name": None}, "name"),
    (_deployment, {"reuse_prefix": 1}, "reuse_prefix"),
    (_storage_deployment, {"share_tp": (3,)}, "share_tp"),
    (_storage_deployment, {"share_tp": (2, 3)}, "share_tp"),
    (MemoryConfig, {"device_tokens": 1000.5}, "device_tokens"),
    (MemoryConfig, {"page_size": "16"}, "page_size"),
    (MemoryConfig, {"page_size": 16.0}, "page_size"),
    (MemoryConfig, {"page_size": None}, "page_size"),
    (MemoryConfig, {"hicache_ratio": float("inf")}, "hicache_ratio"),
    (MemoryConfig, {"hicache_ratio": float("nan")}, "hicache_ratio"),
    (StorageConfig, {"backend": "foo", "model_id": "m"}, "storage_backend"),
    (StorageConfig, {"backend": None}, "backend"),
    (StorageConfig, {"share_pp": (0,)}, "share_pp"),
    (PrefetchConfig, {"timeout_base_s": float("nan")}, "timeout_base_s"),
    (WriteConfig, {"policy": None}, "write_policy"),
]


@pytest.mark.parametrize(("factory", "kwargs", "field"), EDGE_CASES)
def test_every_invalid_setting_is_a_config_error(factory, kwargs, field) -> None:
    with pytest.raises(ConfigError) as info:
        factory(**kwargs)
    assert info.value.field == field, str(info.value)
    assert ";" in str(info.value)  # problem; fix


def test_pools_of_a_cpu_device_must_fit_the_host_budget_together() -> None:
    # the README's first example: 32 layers x 8 KV heads x 128 fp16, 65,536 device tokens
    from hicache_ray.cache.hicache import HiCache

    kv = ShardKV(
        model=ModelKV(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16"),
        shard=Shard(),
        page_size=64,
    )
    config = CacheConfig(memory=MemoryConfig(device_tokens=65536))
    with pytest.raises(ConfigError) as info:
        HiCache(config, kv, device=torch.device("cpu"), host_budget_bytes=20 << 30)
    message = str(info.value)
    assert "device pool 8589934592 bytes" in message and "host pool 17179869184 bytes" in message
    assert "budget of 21474836480 bytes" in message
    # a GPU device keeps its pool in device memory: the host pool alone fits, or is capped
    assert host_pool_pages(config, kv, 20 << 30) == 2048
    assert host_pool_pages(config, kv, 12 << 30) == (12 << 30) // kv.page_bytes
