"""Hugging Face checkpoints of every supported family equal transformers' logits (float32,
within 1e-4) on prefill, split by TP and PP, and over 16 greedy decode steps whose prefixes
come from every cache tier; a broken checkpoint is a ConfigError naming what is wrong."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.layout import Shard, ShardKV
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.cache.controller import CacheController
from hicache_ray.cache.memory import DevicePool
from hicache_ray.engine.model import ReferenceModel
from hicache_ray.engine.model.checkpoint import load_config, resolve_model
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.engine.runtime import RankRuntime
from hicache_ray.keys import plan_shard
from hicache_ray.storage import MemoryObjects, PagedBackend

pytest.importorskip("transformers")
from tests.model.helpers import FAMILIES, VOCAB, hf_logits, make_checkpoint, tp2_forward

TOL = 1e-4
PAGE = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: make_checkpoint(root / family, family) for family in FAMILIES}


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _pool(model_kv: object, shard: Shard, pages: int = 32) -> DevicePool:
    kv = ShardKV(model=model_kv, shard=shard, page_size=PAGE)  # type: ignore[arg-type]
    return DevicePool(kv, pages, torch.device("cpu"))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers_at_tp1_tp2_and_pp2(
    checkpoints: dict[str, Path], family: str
) -> None:
    config = load_config(str(checkpoints[family]))
    tokens = _tokens(23, seed=1)
    want = hf_logits(checkpoints[family], tokens)
    ids, pages = torch.tensor(tokens), list(range(8))
    whole = ReferenceModel(config).forward(
        ids, _pool(config.model_kv(), Shard()), pages, 0, all_logits=True
    )
    _close(whole, want)
    # PP=2: the stages chained in this process
    stages = [ReferenceModel(config, Shard(pp_rank=r, pp_size=2)) for r in range(2)]
    pools = [_pool(config.model_kv(), Shard(pp_rank=r, pp_size=2)) for r in range(2)]
    hidden = stages[0].forward(ids, pools[0], pages, 0)
    _close(stages[1].forward(hidden, pools[1], pages, 0, all_logits=True), want)
    # TP=2: two shards as two threads, summing their partials at every all-reduce
    _close(_tp2_logits(config, ids, pages), want)


def _tp2_logits(config: Any, ids: torch.Tensor, pages: list[int]) -> torch.Tensor:
    def forward(model: ReferenceModel, shard: Shard) -> torch.Tensor:
        pool = _pool(config.model_kv(), shard)
        return model.forward(ids, pool, pages, 0, all_logits=True)

    results = tp2_forward(config, forward)
    assert torch.equal(results[0], results[1])
    return results[0]


def _runtime(config: object, objects: MemoryObjects) -> RankRuntime:
    cache = CacheConfig(
        memory=MemoryConfig(page_size=PAGE, device_tokens=256),
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
        storage=StorageConfig(backend="memory", model_id=config.name),  # type: ignore[attr-defined]
    )
    kv = ShardKV(model=config.model_kv(), shard=Shard(), page_size=PAGE)  # type: ignore[attr-defined]
    backend = PagedBackend("memory", objects, plan_shard(kv, cache), scan_on_start=False)
    ctl = CacheController(cache, kv, storage=backend, host_budget_bytes=1 << 30)
    return RankRuntime(ctl, ReferenceModel(config), keep_logits=True)  # type: ignore[arg-type]


def _run(rt: RankRuntime, rid: str, tokens: list[int], max_new: int) -> object:
    rt.submit(GenerateRequest(rid, tokens, max_new))
    while True:
        for result in rt.step().results:
            if result.rid == rid:
                return result
        rt.ctl.settle(timeout=30)


@pytest.mark.parametrize("tier", ["device", "host", "storage"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sixteen_decode_steps_over_cached_prefixes_match_transformers(
    checkpoints: dict[str, Path], family: str, tier: str
) -> None:
    config = load_config(str(checkpoints[family]))
    objects = MemoryObjects()
    rt = _runtime(config, objects)
    history = _tokens(26, seed=2)
    _run(rt, "warm", history, 1)
    while True:  # host writes and L3 backups done and acknowledged
        rt.ctl.settle(timeout=30)
        if not rt.ctl.step().busy:
            break
    if tier == "host":
        rt.ctl.cache.evict_all()  # L1 goes: the prefix comes back from L2
    if tier == "storage":
        rt.ctl.close()
        rt = _runtime(config, objects)  # new pools: only L3 holds the prefix
    prompt = history + _tokens(7, seed=3)
    result = _run(rt, "turn", prompt, 16)
    hits = {
        "device": result.device_hit_tokens,
        "host": result.host_hit_tokens,  # type: ignore[attr-defined]
        "storage": result.storage_hit_tokens,
    }  # type: ignore[attr-defined]
    assert hits[tier] >= 24, hits
    generated = result.output_tokens  # type: ignore[attr-defined]
    want = hf_logits(checkpoints[family], prompt + generated[:-1])
    got = torch.stack(rt.logits["turn"])
    _close(got, want[len(prompt) - 1 :])
    assert generated == want[len(prompt) - 1 :].argmax(-1).tolist()


def test_a_sharded_checkpoint_loads_and_matches(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "sharded", "qwen2", shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    config = load_config(str(path))
    tokens = _tokens(11, seed=4)
    got = ReferenceModel(config).forward(
        torch.tensor(tokens),
        _pool(config.model_kv(), Shard()),
        list(range(4)),
        0,
        all_logits=True,
    )
    _close(got, hf_logits(path, tokens))


def test_the_revision_names_the_weights(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    llama = load_config(str(checkpoints["llama"]))
    copy = shutil.copytree(checkpoints["llama"], tmp_path / "copy")
    assert load_config(str(copy)).revision == llama.revision  # same files, same revision
    other = make_checkpoint(tmp_path / "other", "llama", seed=5)
    assert load_config(str(other)).revision != llama.revision  # other weights
    assert llama.eos_token_ids == (2,) and llama.max_context == 512
    assert resolve_model(str(checkpoints["llama"])) == llama
    assert resolve_model("tiny").name == "tiny"


def _edited(src: Path, dst: Path, edit: Callable[[dict[str, object]], None]) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_broken_checkpoints_are_config_errors(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    src = checkpoints["llama"]

    def arch(c: dict[str, object]) -> None:
        c["architectures"] = ["GPT2LMHeadModel"]

    def rope(c: dict[str, object]) -> None:
        c["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}

    def shape(c: dict[str, object]) -> None:
        c["intermediate_size"] = 128  # the tensors say 96

    with pytest.raises(ConfigError, match="architecture"):
        load_config(str(_edited(src, tmp_path / "arch", arch)))
    with pytest.raises(ConfigError, match="RoPE type"):
        load_config(str(_edited(src, tmp_path / "rope", rope)))
    wrong = load_config(str(_edited(src, tmp_path / "shape", shape)))
    with pytest.raises(ConfigError, match=r"mlp\.gate_proj\.weight.*expected \[128, 64\]"):
        ReferenceModel(wrong)
    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    (missing / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="safetensors"):
        load_config(str(missing))
    with pytest.raises(ConfigError, match="neither a preset nor a model directory"):
        resolve_model(str(tmp_path / "nothing"))
    dropped = msgspec.structs.replace(load_config(str(src)), qkv_bias=True)  # expects biases
    with pytest.raises(ConfigError, match=r"q_proj\.bias.*missing tensor"):
        ReferenceModel(dropped)
