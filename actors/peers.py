"""How a rank finds the other ranks of its generation: their Ray names."""

from __future__ import annotations

__all__ = ["rank_name"]


def rank_name(name: str, generation: int, rank: int) -> str:
    """The Ray name (namespace ``hicache``) of rank ``rank`` of a deployment's generation."""
    return f"hicache-{name}-g{generation}-rank{rank}"
