"""A rank composed in one place: refusals, and a single rank's parts."""

from __future__ import annotations

import pytest
import torch

from hicache_ray.compose import RankPlace, compose_rank, rank_device
from hicache_ray.model import preset
from hicache_ray.spec import DeploymentConfig


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
