"""The reference model: cached-prefix prefill equals full prefill; TP/PP splits equal TP=1."""

from __future__ import annotations

import pytest
import torch

from hicache_ray.base.errors import ConfigError
from hicache_ray.base.layout import Shard, ShardKV
from hicache_ray.cache.memory import DevicePool
from hicache_ray.engine.model import ModelConfig, ReferenceModel, attention, paged_attention, preset
from tests.model.helpers import tp2_forward

PAGE = 4
TOL = 1e-4  # float32: a chunked softmax and a split sum reorder additions, nothing more


def pool_for(config: ModelConfig, shard: Shard, pages: int = 32) -> DevicePool:
    kv = ShardKV(model=config.model_kv(), shard=shard, page_size=PAGE)
    return DevicePool(kv, pages, torch.device("cpu"))


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def greedy(
    model: ReferenceModel,
    pool: DevicePool,
    pages: list[int],
    ids: torch.Tensor,
    start: int,
    steps: int,
) -> tuple[torch.Tensor, list[int]]:
    """Prefill ``ids[start:]`` over a cached ``ids[:start]``, then decode ``steps`` tokens."""
    logits = model.forward(ids[start:], pool, pages, start)
    first = logits[-1]
    out = [int(first.argmax())]
    pos = len(ids)
    for _ in range(steps - 1):
        nxt = model.forward(torch.tensor(out[-1:]), pool, pages, pos)
        out.append(int(nxt[-1].argmax()))
        pos += 1
    return first, out


@pytest.mark.parametrize("cached", [0, 4, 12, 20])
def test_cached_prefix_prefill_matches_full_prefill(cached: int) -> None:
    config = preset("tiny")
    model = ReferenceModel(config)
    ids = tokens(23)
    full_pool = pool_for(config, Shard())
    full_pages = list(range(10))
    ref, ref_tokens = greedy(model, full_pool, full_pages, ids, 0, 16)
    # Scattered, non-consecutive pages: the prefix is read run by run through the table.
    pool = pool_for(config, Shard())
    pages = [7, 3, 4, 12, 0, 1, 2, 20, 21, 9]
    if cached:
        model.forward(ids[:cached], pool, pages, 0)  # the prefix's KV, as a cache holds it
    got, got_tokens = greedy(model, pool, pages, ids, cached, 16)
    assert torch.allclose(got, ref, atol=TOL, rtol=0), (got - ref).abs().max()
    assert got_tokens == ref_tokens


@pytest.mark.parametrize("fused", [True, False], ids=["fused-runs", "online-softmax"])
@pytest.mark.parametrize("pages", [[3, 4, 0, 9], [2, 3, 4, 5]], ids=["runs", "one-span"])
def test_paged_attention_equals_one_softmax(
    pages: list[int], fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fused:  # the path devices without torch's CPU kernel take
        monkeypatch.setattr(attention, "_FLASH_WITH_LSE", None)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 8, generator=g)
    k_pool = torch.randn(64, 2, 8, generator=g)
    v_pool = torch.randn(64, 2, 8, generator=g)
    start = 10  # queries at positions 10..14 over keys 0..14
    slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(15)])
    k, v = k_pool[slots].repeat_interleave(2, 1), v_pool[slots].repeat_interleave(2, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / 8**0.5
    mask = torch.arange(15)[None, :] > torch.arange(start, 15)[:, None]
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    expected = torch.einsum("hts,shd->thd", probs, v)
    got = paged_attention(q, k_pool, v_pool, pages, PAGE, start)
    assert torch.allclose(got, expected, atol=1e-5)


def test_pipeline_stages_equal_one_stage() -> None:
    config = preset("tiny", num_layers=4)
    ids = tokens(17, seed=2)
    whole = ReferenceModel(config)
    ref = whole.forward(ids, pool_for(config, Shard()), list(range(5)), 0, all_logits=True)
    stages = [ReferenceModel(config, Shard(pp_rank=r, pp_size=2)) for r in range(2)]
    pools = [pool_for(config, Shard(pp_rank=r, pp_size=2)) for r in range(2)]
    hidden = stages[0].forward(ids, pools[0], list(range(5)), 0)
    got = stages[1].forward(hidden, pools[1], list(range(5)), 0, all_logits=True)
    assert got.shape == (17, config.vocab_size)
    assert torch.allclose(got, ref, atol=TOL, rtol=0)


def test_tensor_parallel_shards_sum_to_the_whole_model() -> None:
    # Two TP ranks as two threads of one process, summing their partials at each all-reduce
    # (TP over gloo in separate processes is tested with the runtime).
    config = preset("tiny")
    ids = tokens(13, seed=3)
    ref = ReferenceModel(config).forward(ids, pool_for(config, Shard()), list(range(4)), 0)
    results = tp2_forward(
        config, lambda model, shard: model.forward(ids, pool_for(config, shard), list(range(4)), 0)
    )
    assert torch.allclose(results[0], ref, atol=TOL, rtol=0)
    assert torch.equal(results[0], results[1])


def test_presets_and_bad_sizes() -> None:
    assert preset("bench").model_kv().num_kv_heads == 4
    assert preset("tiny", dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge")
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="vocabulary"):
        ReferenceModel(preset("tiny")).forward(
            torch.tensor([512]), pool_for(preset("tiny"), Shard()), [0], 0
        )
    with pytest.raises(ValueError, match="tp_all_reduce"):
        ReferenceModel(preset("tiny"), Shard(tp_rank=0, tp_size=2))
    tied = ReferenceModel(preset("tiny", tie_embeddings=True))
    assert tied.weights.lm_head is tied.weights.embed
    bf16 = ReferenceModel(preset("tiny", dtype="bfloat16"))
    out = bf16.forward(tokens(8), pool_for(preset("tiny", dtype="bfloat16"), Shard()), [0, 1], 0)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
