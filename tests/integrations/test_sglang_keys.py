"""One key scheme, SGLang's: the backend's namespace digests and object names equal what
SGLang 0.5.23's ``plan_unified_kv`` makes for the same facts, and page hashes (salted or
not) equal SGLang's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sglang.srt.mem_cache.hicache_key_scheme import namespace_digest, plan_unified_kv
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

from hicache_ray.keys import page_hashes, salt_seed
from tests.integrations.helpers import HEADS, LAYERS, PAGE, attach, host_pool, storage_config

TOKENS = list(range(7, 7 + 5 * PAGE + 3))


def _sglang_plan(tp: int, rank: int, layers: tuple[int, int], final: bool, **kw: Any) -> Any:
    return plan_unified_kv(
        dtype="float32",
        page_size=PAGE,
        attn_tp_rank=rank,
        attn_tp_size=tp,
        attn_cp_size=1,
        start_layer=layers[0],
        end_layer=layers[1],
        is_final_stage=final,
        **kw,
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    ("extra", "head_group", "lcm"),
    [
        ({"share_tp": [1, 2, 4]}, 2, None),  # our declaration
        ({}, 2, 4),  # SGLang's tp_lcm_size
        ({}, None, None),  # this TP size alone
    ],
)
def test_mha_keys_equal_plan_unified_kv(
    tmp_path: Path, tp: int, extra: dict[str, Any], head_group: int | None, lcm: int | None
) -> None:
    extra = {"store": "file", "file": {"root": str(tmp_path)}, **extra}
    for rank in range(tp):
        config = storage_config(extra, tp_rank=rank, tp=tp, tp_lcm_size=lcm and max(lcm, tp))
        ours = attach(config, host_pool(tp, "page_first")).plan
        theirs = _sglang_plan(
            tp,
            rank,
            (0, LAYERS),
            True,
            model_id="sgl/test-model",
            rank_replicated=False,
            local_kv_heads=HEADS // tp,
            head_group=head_group,
        )
        assert ours.digest == namespace_digest(theirs.namespace)
        assert [o.suffix for o in ours.objects] == theirs.suffixes
        assert [o.local_heads for o in ours.objects] == theirs.head_ranges * len(
            theirs.layer_ranges
        )


@pytest.mark.parametrize("stage", [0, 1])
def test_pp_and_revision_keys_equal_plan_unified_kv(tmp_path: Path, stage: int) -> None:
    layers = ((0, 2), (2, 4))[stage]
    extra = {
        "store": "file",
        "file": {"root": str(tmp_path)},
        "share_pp": [1, 2],
        "num_layers": LAYERS,
        "model_revision": "abc123",
    }
    config = storage_config(extra, pp_rank=stage, pp=2)
    ours = attach(config, host_pool(1, "layer_first", layers=layers)).plan
    theirs = _sglang_plan(
        1,
        0,
        layers,
        stage == 1,
        model_id="sgl/test-model@abc123",
        rank_replicated=False,
        local_kv_heads=HEADS,
        head_group=HEADS,
        layer_partition=2,
    )
    assert ours.digest == namespace_digest(theirs.namespace)
    assert [o.suffix for o in ours.objects] == theirs.suffixes


def test_mla_keys_equal_plan_unified_kv(tmp_path: Path) -> None:
    extra = {"store": "file", "file": {"root": str(tmp_path)}}
    for rank in range(2):
        config = storage_config(extra, tp_rank=rank, tp=2, mla=True)
        ours = attach(config, host_pool(2, "page_first", mla=True)).plan
        theirs = _sglang_plan(
            2,
            rank,
            (0, LAYERS),
            True,
            model_id="sgl/test-model",
            rank_replicated=True,
            local_kv_heads=1,
        )
        assert ours.digest == namespace_digest(theirs.namespace)
        assert [o.suffix for o in ours.objects] == theirs.suffixes
        assert [o.writer for o in ours.objects] == [rank == 0]


@pytest.mark.parametrize("salt", [None, "tenant-a", "ünïcode"])
def test_page_hashes_equal_sglang(salt: str | None) -> None:
    """A tenant salt is SGLang's ``cache_salt`` (an empty one is no salt here)."""
    seed = storage_namespace_seed(None, salt)
    assert (seed or "") == salt_seed(salt).hex()
    ours = page_hashes(TOKENS, PAGE, salt=salt)
    assert len(ours) == len(TOKENS) // PAGE  # whole pages only: SGLang stores no others
    assert ours == get_hash_str(TOKENS, seed, page_size=PAGE)[: len(ours)]
