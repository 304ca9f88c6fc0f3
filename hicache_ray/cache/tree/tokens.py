"""Comparing encoded token keys page by page (the radix tree's walk)."""

from __future__ import annotations

__all__ = ["common_pages"]


def common_pages(node_key: bytes, key: bytes, pos: int, page: int) -> int:
    """Whole pages of ``page`` bytes that ``node_key`` and ``key[pos:]`` share, the first
    one taken as matched (it is how the child was found)."""
    i = page
    limit = min(len(node_key), len(key) - pos)
    while i + page <= limit and node_key[i : i + page] == key[pos + i : pos + i + page]:
        i += page
    return i // page
