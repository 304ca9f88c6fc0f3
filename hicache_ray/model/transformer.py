"""The reference decoder for one TP/PP rank, reading and writing KV in the device pool.

A forward pass computes the tokens at positions ``[start, start + T)`` of a request whose
pool pages cover ``[0, start + T)``: the KV of ``[0, start)`` is already in the pool (cached,
or loaded by the cache), the KV of the new tokens is written into their slots, and every
layer's attention reads the pool through the page table. ``wait_layer(l)`` is called before
layer ``l`` reads the pool, so a load from the host can overlap the layers before it.

Tensor parallelism splits KV heads (with their query heads) and MLP columns; the attention
output and MLP down projections are summed over the TP group. Pipeline parallelism gives
each stage a contiguous layer range: the first stage embeds tokens, the last returns
logits, the others take and return hidden states (the caller moves them between stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hicache_ray.errors import CollectiveError
from hicache_ray.layout import Shard, ShardKV
from hicache_ray.memory import DevicePool
from hicache_ray.model.attention import paged_attention, position_slots
from hicache_ray.model.config import ModelConfig
from hicache_ray.model.weights import LayerWeights, shard_weights

__all__ = ["ReferenceModel", "TPGroup", "gloo_tp_all_reduce"]

TPGroup = Callable[[torch.Tensor], None]  # in-place SUM all-reduce over the TP ranks


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, H, D]`` (halves convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class ReferenceModel:
    """One rank's share of the reference model.

    Args:
        config: model sizes and seed.
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
        self.weights = shard_weights(
            config, self.shard.tp_rank, self.shard.tp_size, self.layer_range, self.device
        )
        half = config.head_dim // 2
        self._inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, half, device=self.device).float() / half)
        )

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
        """Compute positions ``[start, start + T)``.

        Args:
            inputs: token ids ``[T]`` on the first stage, else hidden states ``[T, hidden]``.
            pool: this rank's device pool (local layers, local KV heads).
            pages: the request's pool pages covering ``[0, start + T)``.
            start: tokens whose KV is already in the pool.
            wait_layer: called with the local layer index before it reads the pool.
            all_logits: logits of every position, not only the last (what sampling needs).

        Returns:
            logits ``[T or 1, vocab]`` (float32) on the last stage, else hidden states.
        """
        w = self.weights
        num = inputs.shape[0]
        if (
            self.first_stage
            and num
            and (int(inputs.min()) < 0 or int(inputs.max()) >= len(w.embed))
        ):
            raise ValueError(f"token ids must lie in [0, {len(w.embed)}) (the vocabulary)")
        x = w.embed[inputs.to(self.device)] if self.first_stage else inputs
        slots = position_slots(pages, pool.page_size, start, start + num).to(self.device)
        angles = torch.arange(start, start + num, device=self.device).float()[:, None]
        angles = angles * self._inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        for local, layer in enumerate(w.layers):
            if wait_layer is not None:
                wait_layer(local)  # this layer's cached prefix must be in the pool
            k_pool, v_pool = pool.layer(local)
            rope = (cos, sin)
            x = x + self._attention(
                x, layer, (k_pool, v_pool), slots, rope, (pages, pool.page_size), start
            )
            x = x + self._mlp(x, layer)
        if not self.last_stage:
            return x
        x = _rms_norm(x, w.norm, self.config.rms_eps)
        return x.float() @ w.lm_head.float().T

    def _attention(
        self,
        x: torch.Tensor,
        w: LayerWeights,
        kv_pool: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        table: tuple[Sequence[int], int],
        start: int,
    ) -> torch.Tensor:
        cfg = self.config
        k_pool, v_pool = kv_pool
        h = _rms_norm(x, w["attn_norm"], cfg.rms_eps)
        num, d = x.shape[0], cfg.head_dim
        q = _rotate((h @ w["q"].T).view(num, self.local_q_heads, d), *rope)
        k = _rotate((h @ w["k"].T).view(num, self.local_kv_heads, d), *rope)
        v = (h @ w["v"].T).view(num, self.local_kv_heads, d)
        k_pool[slots] = k.to(k_pool.dtype)  # the new tokens' KV, into their reserved slots
        v_pool[slots] = v.to(v_pool.dtype)
        out = paged_attention(q, k_pool, v_pool, table[0], table[1], start)
        out = out.reshape(num, -1) @ w["o"].T
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
    """The in-place SUM all-reduce of a gloo process group (``GlooConsensus.group``)."""
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]

    def all_reduce(t: torch.Tensor) -> None:
        try:
            group.allreduce([t], opts).wait()  # type: ignore[attr-defined]
        except RuntimeError as exc:  # a timeout, a dead peer: the group is broken
            raise CollectiveError(f"TP all-reduce failed: {exc}") from exc

    return all_reduce
