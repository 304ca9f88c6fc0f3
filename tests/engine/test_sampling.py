"""Sampling: greedy by default, reproducible when seeded, top-k and top-p honoured."""

from __future__ import annotations

import torch

from hicache_ray.engine.request import SamplingParams
from hicache_ray.engine.sampling import RequestSampler, request_seed


def test_greedy_is_argmax_and_top_k_one_is_greedy() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert RequestSampler("r", SamplingParams()).sample(logits) == 1
    assert RequestSampler("r", SamplingParams(temperature=1.0, top_k=1)).sample(logits) == 1


def test_a_seeded_sampler_repeats_itself() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.5, seed=11)

    def draws(rid: str) -> list[int]:
        sampler = RequestSampler(rid, params)
        return [sampler.sample(logits) for _ in range(50)]

    assert draws("a") == draws("b")  # the seed decides, not the id
    assert len(set(draws("a"))) > 5  # and it does sample
    assert request_seed("a", SamplingParams()) == request_seed("a", SamplingParams())
    assert request_seed("a", SamplingParams()) != request_seed("b", SamplingParams())


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    logits = torch.tensor([5.0, 4.9, 4.8, 0.0, -1.0, -2.0])
    top_k = RequestSampler("k", SamplingParams(temperature=1.0, top_k=2, seed=1))
    assert {top_k.sample(logits) for _ in range(200)} == {0, 1}
    # the three first hold nearly all the mass: top_p 0.5 keeps the first two at most
    top_p = RequestSampler("p", SamplingParams(temperature=1.0, top_p=0.5, seed=1))
    assert {top_p.sample(logits) for _ in range(200)} <= {0, 1}
