"""A look at the tree that changes nothing: how much of a prompt it holds."""

from __future__ import annotations

from hicache_ray.base.tokens import TOKEN_BYTES, TokenIds, encode_tokens
from hicache_ray.cache.tree.radix_tree import HiRadixTree
from hicache_ray.cache.tree.tokens import common_pages

__all__ = ["cached_pages"]


def cached_pages(tree: HiRadixTree, tokens: TokenIds, salt: str = "") -> int:
    """Leading whole pages of ``tokens`` that ``tree`` holds in L1 or L2 under ``salt``'s
    root, as ``match_prefix`` would count them, without its effects: no recency stamp, no
    hit count, no split (a scheduler's guess must not reorder eviction on one rank)."""
    page = tree.page_size * TOKEN_BYTES
    key = encode_tokens(tokens)
    end = len(key) - len(key) % page
    node, pos = tree.roots.of(salt), 0
    while pos < end:
        child = node.children.get(key[pos : pos + page])
        if child is None or child.dead:
            break
        covered = len(child.key)
        if key[pos : pos + covered] != child.key:
            covered = common_pages(child.key, key, pos, page) * page
        covered = min(covered, end - pos)
        pos += covered
        if covered < len(child.key):
            break
        node = child
    return pos // page
