"""The weights one TP/PP rank holds: how each tensor is split, and the seeded random ones.

Tensor parallelism splits KV heads (with their query heads) and MLP columns: q/k/v (and
their biases) and gate/up keep the rows of this rank's heads or columns, o and down keep
the matching columns; norms, embeddings and the output projection are whole on every rank.
Pipeline parallelism keeps the layers of this rank's stage; the first stage holds the
embeddings, the last the final norm and the output projection.

:func:`seeded_weights` draws a model from its seed (every process draws the full weights
in the same order, then keeps its shard, so ranks of any split hold pieces of one model);
:mod:`hicache_ray.engine.model.checkpoint` reads a shard straight from safetensors files.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache_ray.engine.model.config import ModelConfig

__all__ = ["LAYER_SPLITS", "LayerWeights", "ModelWeights", "seeded_weights", "split_tensor"]

LayerWeights = dict[str, torch.Tensor]

# How each layer tensor is split across TP ranks: "q" / "kv" rows by query / KV head,
# "ff" rows of the MLP, "o" / "down" the matching columns, None whole on every rank.
LAYER_SPLITS: dict[str, str | None] = {
    "attn_norm": None,
    "q": "q",
    "k": "kv",
    "v": "kv",
    "q_bias": "q",
    "k_bias": "kv",
    "v_bias": "kv",
    "q_norm": None,
    "k_norm": None,
    "o": "o",
    "mlp_norm": None,
    "gate": "ff",
    "up": "ff",
    "down": "down",
}


class ModelWeights:
    """Embedding, per-layer and output weights of one rank (None where its stage has none)."""

    def __init__(
        self,
        embed: torch.Tensor | None,
        layers: list[LayerWeights],
        norm: torch.Tensor | None,
        lm_head: torch.Tensor | None,
    ) -> None:
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head


def split_ranges(config: ModelConfig, tp_rank: int, tp_size: int) -> dict[str, tuple[int, int]]:
    """[lo, hi) of this rank along each split kind (rows for q/kv/ff, columns for o/down)."""
    d = config.head_dim
    q = config.num_heads // tp_size * d
    kv = config.num_kv_heads // tp_size * d
    ff = config.intermediate_size // tp_size
    return {
        "q": (tp_rank * q, (tp_rank + 1) * q),
        "kv": (tp_rank * kv, (tp_rank + 1) * kv),
        "ff": (tp_rank * ff, (tp_rank + 1) * ff),
        "o": (tp_rank * q, (tp_rank + 1) * q),
        "down": (tp_rank * ff, (tp_rank + 1) * ff),
    }


def split_tensor(name: str, t: torch.Tensor, ranges: dict[str, tuple[int, int]]) -> torch.Tensor:
    """This rank's part of layer tensor ``name`` (rows, columns, or all of it)."""
    kind = LAYER_SPLITS[name]
    if kind is None:
        return t
    lo, hi = ranges[kind]
    return t[:, lo:hi] if kind in ("o", "down") else t[lo:hi]


def _draw_layer(config: ModelConfig, normal: Callable[..., torch.Tensor]) -> LayerWeights:
    h, d = config.hidden_size, config.head_dim
    q, kv, ff = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    layer = {
        "attn_norm": 1.0 + normal(h, scale=0.1),
        "q": normal(q, h, scale=h**-0.5),
        "k": normal(kv, h, scale=h**-0.5),
        "v": normal(kv, h, scale=h**-0.5),
        "o": normal(h, q, scale=q**-0.5),
        "mlp_norm": 1.0 + normal(h, scale=0.1),
        "gate": normal(ff, h, scale=h**-0.5),
        "up": normal(ff, h, scale=h**-0.5),
        "down": normal(h, ff, scale=ff**-0.5),
    }
    if config.qkv_bias:
        layer |= {
            f"{n}_bias": normal(size, scale=0.1) for n, size in (("q", q), ("k", kv), ("v", kv))
        }
    if config.qk_norm:
        layer |= {"q_norm": 1.0 + normal(d, scale=0.1), "k_norm": 1.0 + normal(d, scale=0.1)}
    return layer


def seeded_weights(
    config: ModelConfig,
    tp_rank: int,
    tp_size: int,
    layer_range: tuple[int, int],
    device: torch.device,
) -> ModelWeights:
    """This rank's shard of the model drawn from ``config.seed``, in ``config.dtype``."""
    g = torch.Generator().manual_seed(config.seed)

    def normal(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    h = config.hidden_size
    embed = normal(config.vocab_size, h, scale=1.0)
    layers = [_draw_layer(config, normal) for _ in range(config.num_layers)]
    norm = 1.0 + normal(h, scale=0.1)
    lm_head = embed if config.tie_embeddings else normal(config.vocab_size, h, scale=h**-0.5)
    ranges = split_ranges(config, tp_rank, tp_size)
    dtype = getattr(torch, config.dtype)

    def place(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    mine = [
        {name: place(split_tensor(name, t, ranges)) for name, t in layer.items()}
        for layer in layers[layer_range[0] : layer_range[1]]
    ]
    return ModelWeights(place(embed), mine, place(norm), place(lm_head))
