"""Sampling the next token: greedy (the default, and the exactness reference) or seeded.

Each request samples with its own ``torch.Generator`` seeded from its ``SamplingParams``
(or, without a seed, from its request id), so a sampled run is reproducible: on every rank
(the logits are identical after the TP all-reduces, and the root broadcasts the tokens
anyway), after a retry in a new generation of ranks, and between runs.
"""

from __future__ import annotations

import hashlib

import torch

from hicache_ray.engine.request import SamplingParams

__all__ = ["RequestSampler", "request_seed"]


def request_seed(rid: str, params: SamplingParams) -> int:
    """The seed of a request's generator: its own, or one derived from its id."""
    if params.seed is not None:
        return params.seed
    return int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "little") >> 1


class RequestSampler:
    """One request's sampling state."""

    def __init__(self, rid: str, params: SamplingParams) -> None:
        self.params = params
        self.greedy = params.temperature == 0.0 or params.top_k == 1
        self._generator: torch.Generator | None = None
        if not self.greedy:
            self._generator = torch.Generator().manual_seed(request_seed(rid, params))

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from one row of logits ``[vocab]``."""
        if self.greedy:
            return int(logits.argmax())
        p = self.params
        scores = logits.float().cpu() / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always the first token)
            drop = ordered.cumsum(-1) - ordered >= p.top_p
            probs = probs.scatter(0, order, ordered.masked_fill(drop, 0.0))
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self._generator))
