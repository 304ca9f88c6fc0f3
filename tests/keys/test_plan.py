from __future__ import annotations

import msgspec
import pytest

from hicache_ray.base.config import CacheConfig, MemoryConfig
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.layout import ModelKV, Shard, ShardKV
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.keys import (
    KVCacheNamespace,
    PlanKeys,
    ShardPlan,
    check_keys,
    describe_sharing,
    plan_shard,
    sharing_grid,
)


def _kv(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, *, heads=8, layers=8, mla=False, cp=1):
    model = ModelKV(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=4,
        dtype="float16",
        kv_lora_rank=8 if mla else 0,
        qk_rope_head_dim=4 if mla else 0,
    )
    shard = Shard(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_size=cp
    )
    return ShardKV(model=model, shard=shard, page_size=4)


def _config(scheme="unified", **storage) -> CacheConfig:
    return CacheConfig(
        memory=MemoryConfig(page_size=4, device_tokens=64),
        storage=StorageConfig(backend="memory", model_id="org/model", key_scheme=scheme, **storage),
    )


def _suffixes(plan: ShardPlan) -> set[str]:
    return {o.suffix for o in plan.objects}


def test_unified_key_grammar() -> None:
    plan = plan_shard(_kv(1, 4), _config(share_tp=(4,), share_pp=(1, 2)))
    digest = plan.digest
    assert digest.startswith("ukv1-") and len(digest) == 5 + 16
    # SGLang's coordinates: half-open layer ranges, global head-group index
    assert [o.suffix for o in plan.objects] == [f"{digest}_L0-4_H1", f"{digest}_L4-8_H1"]
    h = "ab" * 32
    assert plan.keys(h) == [f"{h}_{digest}_L0-4_H1", f"{h}_{digest}_L4-8_H1"]
    assert plan.owns(plan.keys(h)[0]) and not plan.owns(f"{h}_ukv1-{'0' * 16}_L0-4_H1")
    check_keys(plan.keys(h))
    assert plan.spec_of(plan.keys(h)[1]) == plan.objects[1] and plan.spec_of(h + "_x") is None


@pytest.mark.parametrize(("small", "large"), [(1, 2), (2, 4), (1, 4), (4, 8)])
def test_a_tp_rank_owns_the_union_of_the_larger_tp_ranks_it_covers(small, large) -> None:
    config = _config(share_tp=(small, large))
    ratio = large // small
    for rank in range(small):
        mine = plan_shard(_kv(rank, small), config)
        covered = set().union(
            *(_suffixes(plan_shard(_kv(rank * ratio + r, large), config)) for r in range(ratio))
        )
        assert _suffixes(mine) == covered


def test_pp1_owns_the_union_of_the_stages() -> None:
    config = _config(share_tp=(1,), share_pp=(1, 2, 4))
    whole = _suffixes(plan_shard(_kv(), config))
    assert len(whole) == 4  # layer chunks of 2: gcd of every split's stage starts
    for pp in (2, 4):
        stages = set().union(
            *(_suffixes(plan_shard(_kv(pp_rank=r, pp_size=pp), config)) for r in range(pp))
        )
        assert stages == whole


def test_uneven_stages_follow_sglangs_split_and_share() -> None:
    # 7 layers over 2 stages: SGLang gives the extra layer to the last stage (0-3, 3-7)
    config = _config(share_pp=(1, 2))
    assert sharing_grid(_kv(layers=7).model, 1, 2, config.storage).layer_partition == 3
    whole = _suffixes(plan_shard(_kv(layers=7), config))
    stages = _suffixes(plan_shard(_kv(0, 1, 0, 2, layers=7), config)) | _suffixes(
        plan_shard(_kv(0, 1, 1, 2, layers=7), config)
    )
    assert stages == whole and any(s.endswith("_L6-7_H0") for s in whole)


def test_bytes_locations_point_into_the_rank_pools() -> None:
    plan = plan_shard(_kv(1, 2, pp_rank=1, pp_size=2), _config(share_tp=(2, 4), share_pp=(2, 4)))
    first = plan.objects[0]
    assert first.layers == (4, 6) and first.local_layers == (0, 2)
    assert first.head_group == 2 and first.local_heads == (0, 2)
    assert plan.objects[1].local_heads == (2, 4)
    assert first.shape == (2, 2, 4, 2, 4) and first.num_bytes == 2 * 2 * 4 * 2 * 4 * 2


def test_nothing_declared_shares_with_this_shape_only() -> None:
    storage = _config().storage
    grid = sharing_grid(_kv(0, 2, 0, 2).model, 2, 2, storage)
    assert grid.head_group == 4 and grid.layer_partition == 0
    plan = plan_shard(_kv(1, 2, 1, 2), _config())
    assert _suffixes(plan) == {f"{plan.digest}_L4-8_H1"}  # the stage's own range
    line = describe_sharing(_kv().model, 2, 2, storage)
    assert "TP in [2]" in line and "PP in [2]" in line and "share_tp" in line


def test_mla_is_one_object_per_layer_chunk_written_by_tp_rank_0() -> None:
    config = _config(share_pp=(1, 2))
    plans = [plan_shard(_kv(r, 4, mla=True), config) for r in range(4)]
    assert all(_suffixes(p) == _suffixes(plans[0]) for p in plans)
    assert all("_H" not in s for s in _suffixes(plans[0]))
    assert [p.objects[0].writer for p in plans] == [True, False, False, False]
    assert plans[0].objects[0].shape == (4, 1, 4, 1, 12)
    assert plans[0].namespace.head_group == plans[0].namespace.total_kv_heads == 0


def test_rank_suffix_keys() -> None:
    config = _config(scheme="rank-suffix")
    assert _suffixes(plan_shard(_kv(1, 2), config)) == {"org-model_1_2"}
    assert _suffixes(plan_shard(_kv(1, 2, 1, 2), config)) == {"org-model_1_2_2_1"}
    mla = [plan_shard(_kv(r, 2, mla=True), config) for r in range(2)]
    assert _suffixes(mla[0]) == _suffixes(mla[1]) == {"org-model"}
    assert [p.objects[0].writer for p in mla] == [True, False]
    plan = plan_shard(_kv(0, 2), config)
    assert plan.owns("a" * 64 + "_org-model_0_2") and not plan.owns("a" * 64 + "_org-model2_0_2")
    check_keys(plan.keys("a" * 64))


@pytest.mark.parametrize(
    ("kv_args", "storage", "field", "hint"),
    [
        ({"tp_size": 2}, {"share_tp": (4,)}, "share_tp", "leaves out"),
        ({"tp_size": 2}, {"share_tp": (2, 3)}, "share_tp", "6 equal groups"),
        ({"heads": 6, "tp_size": 2}, {"share_tp": (2, 4)}, "share_tp", "4 equal groups"),
        ({"pp_size": 2}, {"share_pp": (1,)}, "share_pp", "leaves out"),
        ({"pp_size": 2}, {"share_pp": (2, 16)}, "share_pp", "exceed"),
        ({"cp": 2}, {}, "key_scheme", "rank-suffix"),
    ],
)
def test_declarations_that_do_not_tile_are_refused(kv_args, storage, field, hint) -> None:
    tp_size = kv_args.pop("tp_size", 1)
    pp_size = kv_args.pop("pp_size", 1)
    kv = _kv(tp_size - 1, tp_size, pp_size - 1, pp_size, **kv_args)
    with pytest.raises(ConfigError, match=hint) as info:
        plan_shard(kv, _config(**storage))
    assert info.value.field == field


@pytest.mark.parametrize("sizes", [(0,), (2, 2), (-1,)])
def test_bad_sharing_declarations_are_config_errors(sizes) -> None:
    with pytest.raises(ConfigError, match="share_tp"):
        StorageConfig(share_tp=sizes)


def test_one_head_per_rank_needs_nothing_extra() -> None:
    plan = plan_shard(_kv(7, 8), _config(share_tp=(8,)))
    assert _suffixes(plan) == {f"{plan.digest}_L0-8_H7"}


def test_every_namespace_field_changes_the_digest() -> None:
    base = plan_shard(_kv(), _config(share_tp=(1, 2))).namespace
    changes = {
        "schema_version": 2,
        "model_id": "other",
        "dtype": "bfloat16",
        "page_size": 8,
        "rank_replicated": True,
        "total_kv_heads": 16,
        "layer_partition": 2,
        "head_group": 2,
        "object_layout": "page-unified-v2",
    }
    assert set(changes) == set(KVCacheNamespace.__struct_fields__)
    digests = {msgspec.structs.replace(base, **{k: v}).digest for k, v in changes.items()}
    assert len(digests) == len(changes) and base.digest not in digests


def test_revision_is_part_of_the_model_id_and_the_salt_is_not_in_the_namespace() -> None:
    plain = plan_shard(_kv(), _config())
    revised = plan_shard(_kv(), _config(model_revision="v2"))
    salted = plan_shard(_kv(), _config(tenant_salt="t"))
    assert revised.namespace.model_id == "org/model@v2" and revised.digest != plain.digest
    assert salted.digest == plain.digest  # the salt seeds the page hashes instead


def test_namespace_and_plan_round_trip_through_msgpack() -> None:
    plan = plan_shard(_kv(1, 2), _config(share_tp=(2, 4)))
    data = msgspec.msgpack.encode(plan)
    assert msgspec.msgpack.decode(data, type=ShardPlan) == plan


@pytest.mark.parametrize(
    "key",
    [
        "../../victim",
        "a" * 64 + "/../x",
        "a" * 64 + "_..",
        "a" * 64,
        "A" * 64 + "_x",
        "a" * 64 + "_x\x00",
        "a" * 64 + "_" + "x" * 300,
        b"a" * 64,
        7,
        None,
    ],
)
def test_keys_outside_the_grammar_are_refused(key) -> None:
    with pytest.raises(ValueError, match="key"):
        check_keys(["a" * 64 + "_ok", key])


def test_keys_of_pages_are_their_keys_in_order_and_pass_the_check_as_they_are() -> None:
    plan = plan_shard(_kv(1, 4), _config(share_tp=(4,), share_pp=(1, 2)))
    hashes = ["ab" * 32, "0f" * 32, "ab" * 32]
    keys = plan.keys_of(hashes)
    assert list(keys) == [k for h in hashes for k in plan.keys(h)]
    assert isinstance(keys, PlanKeys) and plan.keys_of([]) == ()
    check_keys(keys)  # made of checked hashes and suffixes: no scan
    check_keys(keys[1:])  # a slice is a plain tuple: scanned, and of the grammar


@pytest.mark.parametrize("page_hash", ["AB" * 32, "ab" * 31, "ab" * 32 + "_x", "../" * 22, 7, None])
def test_keys_of_a_page_hash_outside_the_grammar_are_refused(page_hash) -> None:
    plan = plan_shard(_kv(), _config())
    with pytest.raises(ValueError, match="page hash"):
        plan.keys_of(["ab" * 32, page_hash])


def test_keys_of_a_plan_whose_suffix_makes_no_key_are_refused() -> None:
    plan = plan_shard(_kv(), _config())
    bad = msgspec.structs.replace(plan.objects[0], suffix="x/../../victim")
    with pytest.raises(ValueError, match="key grammar"):
        msgspec.structs.replace(plan, objects=(bad,)).keys_of(["ab" * 32])
