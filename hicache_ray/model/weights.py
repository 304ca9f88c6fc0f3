"""Seeded weights of the reference model, and the slice one TP/PP rank holds.

Every process draws the full weights from the same seed in the same order, then keeps its
shard, so ranks of any TP/PP split hold exactly the pieces of one model.
"""

from __future__ import annotations

import torch

from hicache_ray.model.config import ModelConfig

__all__ = ["LayerWeights", "ModelWeights", "shard_weights"]

LayerWeights = dict[str, torch.Tensor]


class ModelWeights:
    """Embedding, per-layer and output weights (full, or one rank's shard)."""

    def __init__(
        self,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
    ) -> None:
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head


def _draw(config: ModelConfig) -> ModelWeights:
    g = torch.Generator().manual_seed(config.seed)
    h, d = config.hidden_size, config.head_dim

    def normal(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    embed = normal(config.vocab_size, h, scale=1.0)
    layers = []
    for _ in range(config.num_layers):
        layers.append(
            {
                "attn_norm": 1.0 + normal(h, scale=0.1),
                "q": normal(config.num_heads * d, h, scale=h**-0.5),
                "k": normal(config.num_kv_heads * d, h, scale=h**-0.5),
                "v": normal(config.num_kv_heads * d, h, scale=h**-0.5),
                "o": normal(h, config.num_heads * d, scale=(config.num_heads * d) ** -0.5),
                "mlp_norm": 1.0 + normal(h, scale=0.1),
                "gate": normal(config.intermediate_size, h, scale=h**-0.5),
                "up": normal(config.intermediate_size, h, scale=h**-0.5),
                "down": normal(h, config.intermediate_size, scale=config.intermediate_size**-0.5),
            }
        )
    norm = 1.0 + normal(h, scale=0.1)
    lm_head = embed if config.tie_embeddings else normal(config.vocab_size, h, scale=h**-0.5)
    return ModelWeights(embed, layers, norm, lm_head)


def shard_weights(
    config: ModelConfig,
    tp_rank: int,
    tp_size: int,
    layer_range: tuple[int, int],
    device: torch.device,
) -> ModelWeights:
    """This rank's weights: its KV heads (with their query heads) and MLP columns, for
    the layers of its PP stage, in ``config.dtype`` on ``device``."""
    if config.num_kv_heads % tp_size or config.intermediate_size % tp_size:
        raise ValueError(
            f"tp_size={tp_size} must divide num_kv_heads={config.num_kv_heads} and "
            f"intermediate_size={config.intermediate_size}"
        )
    full = _draw(config)
    dtype = getattr(torch, config.dtype)
    d = config.head_dim
    kv_per = config.num_kv_heads // tp_size
    q_per = config.num_heads // tp_size
    ff_per = config.intermediate_size // tp_size

    def rows(t: torch.Tensor, per: int) -> torch.Tensor:
        return t[tp_rank * per : (tp_rank + 1) * per]

    def cols(t: torch.Tensor, per: int) -> torch.Tensor:
        return t[:, tp_rank * per : (tp_rank + 1) * per]

    def place(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    layers = []
    for w in full.layers[layer_range[0] : layer_range[1]]:
        local = {
            "attn_norm": w["attn_norm"],
            "q": rows(w["q"], q_per * d),
            "k": rows(w["k"], kv_per * d),
            "v": rows(w["v"], kv_per * d),
            "o": cols(w["o"], q_per * d),
            "mlp_norm": w["mlp_norm"],
            "gate": rows(w["gate"], ff_per),
            "up": rows(w["up"], ff_per),
            "down": cols(w["down"], ff_per),
        }
        layers.append({k: place(v) for k, v in local.items()})
    return ModelWeights(place(full.embed), layers, place(full.norm), place(full.lm_head))
