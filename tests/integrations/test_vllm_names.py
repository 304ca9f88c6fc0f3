"""Pages SGLang stores through hicache-ray's backend are the pages the vLLM connector looks
for: the same page hashes (SGLang's ``get_hash_str``) and object names, so the connector's
lookup finds them. (The connector itself runs on vLLM in tests/vllm.)"""

from __future__ import annotations

from pathlib import Path

import torch
from sglang.srt.mem_cache.utils import get_hash_str

from hicache_ray.base.layout import ModelKV
from hicache_ray.integrations.vllm.pages import PagePlanner
from hicache_ray.integrations.vllm.setup import (
    parse_options,
    rank_plan,
    storage_config,
    tp_suffixes,
)
from hicache_ray.keys import page_hashes
from hicache_ray.storage import PagedBackend, create_backend
from tests.integrations.helpers import HEAD_DIM, HEADS, LAYERS, PAGE, attach, host_pool
from tests.integrations.helpers import storage_config as sglang_config

TOKENS = list(range(500, 500 + 3 * PAGE + 1))


def test_the_connector_finds_what_sglang_tp2_stored(tmp_path: Path) -> None:
    hashes = get_hash_str(TOKENS[: 3 * PAGE], None, page_size=PAGE)  # SGLang's whole pages
    assert hashes == page_hashes(TOKENS, PAGE)
    extra = {"store": "file", "file": {"root": str(tmp_path)}, "share_tp": [1, 2]}
    slots = torch.arange(len(hashes) * PAGE)
    for rank in range(2):
        writer = attach(sglang_config(extra, tp_rank=rank, tp=2), host_pool(2, "page_first"))
        assert writer.batch_set_v1(hashes, slots) == [True] * len(hashes)
        writer.close()
    options = parse_options({**extra, "model_id": "sgl/test-model"})
    storage = storage_config(options, "served-name")
    model = ModelKV(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float32")
    for tp in (1, 2):  # a vLLM engine of either size finds every page
        suffixes = tp_suffixes(model, PAGE, storage, tp)
        backend = create_backend(storage, rank_plan(model, PAGE, storage, 0, tp))
        assert isinstance(backend, PagedBackend)
        planner = PagePlanner(backend, suffixes, PAGE, "")
        assert planner.lookup("r", TOKENS, 0, "") == len(hashes) * PAGE
        backend.close()
