"""The decoder for one TP/PP rank, reading and writing KV in the device pool, in batches.

A forward pass computes a batch of *segments*: segment ``i`` is the tokens at positions
``[start_i, start_i + T_i)`` of one request whose pool pages cover ``[0, start_i + T_i)``.
The KV of ``[0, start_i)`` is already in the pool (cached, loaded by the cache, or computed
by earlier steps), the KV of the new tokens is written into their slots, and every layer's
attention reads the pool through each request's page table. Projections, norms and the MLP
run once over all the batch's tokens; attention runs per segment. ``wait_layer(l)`` is
called before layer ``l`` reads the pool, so loads from the host overlap the layers before.

Tensor parallelism splits KV heads (with their query heads) and MLP columns; the attention
output and MLP down projections are summed over the TP group (one all-reduce each per layer
for the whole batch). Pipeline parallelism gives each stage a contiguous layer range: the
first stage embeds tokens, the last returns logits, the others take and return hidden
states (the caller moves them between stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hicache_ray.base.errors import CollectiveError
from hicache_ray.base.layout import Shard, ShardKV
from hicache_ray.cache.memory import DevicePool
from hicache_ray.engine.model.attention import paged_attention, position_slots
from hicache_ray.engine.model.config import ModelConfig
from hicache_ray.engine.model.rope import inverse_frequencies, rotate
from hicache_ray.engine.model.weights import LayerWeights, ModelWeights, seeded_weights

__all__ = ["ReferenceModel", "Segment", "TPGroup", "gloo_tp_all_reduce"]

TPGroup = Callable[[torch.Tensor], None]  # in-place SUM all-reduce over the TP ranks


@dataclass(frozen=True)
class Segment:
    """One request's tokens in a batch: positions ``[start, start + length)``; ``pages``
    are its pool pages covering ``[0, start + length)``."""

    pages: Sequence[int]
    start: int
    length: int


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: statistics in float32, the weight applied in
    the input's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * normed.to(x.dtype)


class ReferenceModel:
    """One rank's share of a decoder (seeded random weights, or a checkpoint's).

    Args:
        config: the model.
        shard: this rank's TP/PP coordinates.
        tp_all_reduce: SUM all-reduce over the TP group (in place); omitted for TP=1.
        device: where weights live (the device pool's device).
    """

    def __init__(
        self,
        config: ModelConfig,
        shard: Shard | None = None,
        *,
        tp_all_reduce: TPGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.shard = shard or Shard()
        if self.shard.tp_size > 1 and tp_all_reduce is None:
            raise ValueError(f"tp_size={self.shard.tp_size} needs a tp_all_reduce")
        self._all_reduce = tp_all_reduce
        self.device = device or torch.device("cpu")
        kv = ShardKV(model=config.model_kv(), shard=self.shard, page_size=1)
        self.layer_range = kv.layer_range
        self.local_kv_heads = kv.local_heads
        self.local_q_heads = config.num_heads // self.shard.tp_size
        self.first_stage = self.shard.pp_rank == 0
        self.last_stage = self.shard.pp_rank == self.shard.pp_size - 1
        self.weights = self._load()
        self._inv_freq = inverse_frequencies(config, self.device)

    def _load(self) -> ModelWeights:
        s, cfg = self.shard, self.config
        if cfg.intermediate_size % s.tp_size or cfg.num_kv_heads % s.tp_size:
            raise ValueError(
                f"tp_size={s.tp_size} must divide num_kv_heads={cfg.num_kv_heads} and "
                f"intermediate_size={cfg.intermediate_size}"
            )
        if not cfg.checkpoint:
            return seeded_weights(cfg, s.tp_rank, s.tp_size, self.layer_range, self.device)
        from hicache_ray.engine.model.checkpoint import load_shard

        return load_shard(
            cfg,
            s.tp_rank,
            s.tp_size,
            self.layer_range,
            self.device,
            first_stage=self.first_stage,
            last_stage=self.last_stage,
        )

    # ---------------------------------------------------------------- forward

    def forward(
        self,
        inputs: torch.Tensor,
        pool: DevicePool,
        pages: Sequence[int],
        start: int,
        *,
        wait_layer: Callable[[int], None] | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """One segment: positions ``[start, start + T)`` (see :meth:`forward_batch`).

        Returns:
            logits ``[T or 1, vocab]`` (float32) on the last stage, else hidden states.
        """
        num = inputs.shape[0]
        rows = list(range(num)) if all_logits else [num - 1]
        return self.forward_batch(
            inputs, [Segment(pages, start, num)], pool, wait_layer=wait_layer, logit_rows=rows
        )

    def forward_batch(
        self,
        inputs: torch.Tensor,
        segments: Sequence[Segment],
        pool: DevicePool,
        *,
        wait_layer: Callable[[int], None] | None = None,
        logit_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Compute every segment's new tokens.

        Args:
            inputs: token ids ``[N]`` on the first stage, else hidden states ``[N, hidden]``,
                segments concatenated in order (``N`` is the sum of their lengths).
            segments: the batch's requests.
            pool: this rank's device pool (local layers, local KV heads).
            wait_layer: called with the local layer index before it reads the pool.
            logit_rows: the rows of ``inputs`` to compute logits for (the last stage);
                default each segment's last token.

        Returns:
            logits ``[len(logit_rows), vocab]`` (float32) on the last stage, else hidden
            states ``[N, hidden]``.
        """
        w, cfg = self.weights, self.config
        num = inputs.shape[0]
        if num != sum(s.length for s in segments):
            raise ValueError(f"{num} inputs for segments of {sum(s.length for s in segments)}")
        if self.first_stage:
            assert w.embed is not None
            if num and (int(inputs.min()) < 0 or int(inputs.max()) >= len(w.embed)):
                raise ValueError(f"token ids must lie in [0, {len(w.embed)}) (the vocabulary)")
            x = w.embed[inputs.to(self.device)]
        else:
            x = inputs.to(self.device)
        page_size = pool.page_size
        slots = torch.cat(
            [position_slots(s.pages, page_size, s.start, s.start + s.length) for s in segments]
        ).to(self.device)
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments])
        angles = positions.to(self.device).float()[:, None] * self._inv_freq[None, :]
        rope = (angles.cos()[:, None, :], angles.sin()[:, None, :])
        for local, layer in enumerate(w.layers):
            if wait_layer is not None:
                wait_layer(local)  # this layer's cached prefixes must be in the pool
            k_pool, v_pool = pool.layer(local)
            x = x + self._attention(x, layer, (k_pool, v_pool), slots, rope, segments, page_size)
            x = x + self._mlp(x, layer)
        if not self.last_stage:
            return x
        assert w.norm is not None and w.lm_head is not None
        if logit_rows is None:
            ends = torch.tensor([s.length for s in segments]).cumsum(0) - 1
            logit_rows = ends.tolist()
        picked = x[torch.as_tensor(list(logit_rows), dtype=torch.long, device=x.device)]
        h = _rms_norm(picked, w.norm, cfg.rms_eps)
        return h.float() @ w.lm_head.float().T

    def _attention(
        self,
        x: torch.Tensor,
        w: LayerWeights,
        kv_pool: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        segments: Sequence[Segment],
        page_size: int,
    ) -> torch.Tensor:
        cfg = self.config
        k_pool, v_pool = kv_pool
        h = _rms_norm(x, w["attn_norm"], cfg.rms_eps)
        num, d = x.shape[0], cfg.head_dim
        q, k, v = h @ w["q"].T, h @ w["k"].T, h @ w["v"].T
        if "q_bias" in w:
            q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
        q = q.view(num, self.local_q_heads, d)
        k = k.view(num, self.local_kv_heads, d)
        if "q_norm" in w:
            q = _rms_norm(q, w["q_norm"], cfg.rms_eps)
            k = _rms_norm(k, w["k_norm"], cfg.rms_eps)
        q, k = rotate(q, *rope), rotate(k, *rope)
        k_pool[slots] = k.to(k_pool.dtype)  # the new tokens' KV, into their reserved slots
        v_pool[slots] = v.view(num, self.local_kv_heads, d).to(v_pool.dtype)
        outs = []
        first = 0
        for s in segments:
            seg_q = q[first : first + s.length]
            outs.append(paged_attention(seg_q, k_pool, v_pool, s.pages, page_size, s.start))
            first += s.length
        out = torch.cat(outs).reshape(num, -1) @ w["o"].T
        self._reduce(out)
        return out

    def _mlp(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        h = _rms_norm(x, w["mlp_norm"], self.config.rms_eps)
        out = (torch.nn.functional.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T
        self._reduce(out)
        return out

    def _reduce(self, t: torch.Tensor) -> None:
        if self._all_reduce is not None and self.shard.tp_size > 1:
            self._all_reduce(t)


def gloo_tp_all_reduce(group: object) -> TPGroup:
    """The in-place SUM all-reduce of a process group (gloo on CPU, NCCL on CUDA)."""
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]

    def all_reduce(t: torch.Tensor) -> None:
        try:
            group.allreduce([t], opts).wait()  # type: ignore[attr-defined]
        except RuntimeError as exc:  # a timeout, a dead peer: the group is broken
            raise CollectiveError(f"TP all-reduce failed: {exc}") from exc

    return all_reduce
