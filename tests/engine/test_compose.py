"""A rank composed in one place: refusals, and a single rank's parts."""

from __future__ import annotations

import pytest
import torch

from hicache_ray.cache.events import BlockStored
from hicache_ray.engine.compose import RankPlace, compose_rank, rank_device
from hicache_ray.engine.model import preset
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.engine.spec import DeploymentConfig


def test_ranks_of_a_larger_deployment_need_a_store_to_meet_on() -> None:
    config = DeploymentConfig(model=preset("tiny4"), tp_size=2)
    with pytest.raises(ValueError, match="store to meet on"):
        compose_rank(config)
    with pytest.raises(ValueError, match="store to meet on"):
        compose_rank(config, RankPlace(rank=1))


def test_a_single_rank_has_no_groups_and_follows_its_config() -> None:
    config = DeploymentConfig(model=preset("tiny"), reuse_prefix=False)
    rank = compose_rank(config)
    try:
        assert rank.groups == [] and rank.model_backend == "gloo"
        assert rank.runtime.reuse_prefix is False
        assert rank.runtime.max_step_tokens == config.scheduler.max_step_tokens
        assert rank.controller.consensus.world_size == 1
    finally:
        rank.close()


def test_a_rank_is_on_the_cpu_unless_it_reserves_a_gpu_it_sees() -> None:
    assert rank_device(DeploymentConfig()) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert rank_device(DeploymentConfig(gpus_per_rank=1)).type == expected


def test_rank_0_journals_its_tree_one_batch_per_step_that_changed_it() -> None:
    config = DeploymentConfig(model=preset("tiny"))
    rank = compose_rank(config)
    try:
        events = rank.controller.events
        assert events is not None and rank.controller.cache.tree.observer is events
        rt = rank.runtime
        rt.submit(GenerateRequest("a", list(range(40)), 2))
        while rt.has_work:
            rt.step()
        rt.step()  # the next step publishes what the last one changed
        batches = events.since(0)
        assert batches is not None and [b.seq for b in batches] == list(range(1, events.seq + 1))
        stored = [e for b in batches for e in b.batch.events if isinstance(e, BlockStored)]
        page = config.cache.memory.page_size
        assert sum(len(e.block_hashes) for e in stored) >= 40 // page
        quiet = events.seq
        rt.step()
        assert events.seq == quiet  # an idle step adds no batch
    finally:
        rank.close()
