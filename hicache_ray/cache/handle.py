"""One request's hold on a rank's cache (:class:`CacheHandle`) and the error of a device pool
that cannot hold a request. Re-exported by :mod:`hicache_ray.cache.hicache`."""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache_ray.base.errors import HiCacheError
from hicache_ray.cache.memory import Transfer
from hicache_ray.cache.tree import TreeNode

__all__ = ["CacheFullError", "CacheHandle"]


class CacheFullError(HiCacheError):
    """The device pool cannot give a request the pages it asked for, even after eviction."""


@dataclass
class CacheHandle:
    """One request's hold on the cache, from ``match`` to ``finish``.

    Attributes:
        key: the request's tokens as tree key bytes at match time.
        prompt_key: the whole prompt as key bytes, when the caller encoded it (the
            controller does, once per request): reused to insert the prompt at finish.
        device_pages: device pages of the cached prefix, then of reserved tokens, in order.
        num_cached_tokens: tokens whose KV is (or is being loaded) on the device.
        device_hit_tokens / host_hit_tokens: where the cached prefix came from.
        salt: the request's cache salt (the tree root it matched under and inserts into).
    """

    key: bytes
    device_pages: list[int]
    num_cached_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    locked_node: TreeNode
    loads: list[Transfer] = field(default_factory=list)
    loaded_nodes: list[TreeNode] = field(default_factory=list)
    extra_pages: list[int] = field(default_factory=list)  # loaded from outside the tree
    storage_hit_tokens: int = 0  # of the cached prefix, read from L3 for this request
    num_reserved_pages: int = 0
    num_tokens: int = 0  # tokens with a device slot: cached plus reserved
    finished: bool = False
    prompt_key: bytes = b""
    salt: str = ""
    prompt_cached: bool = False  # HiCache.cache_prompt put some of its prompt in the tree

    def __post_init__(self) -> None:
        self.num_tokens = self.num_cached_tokens

    def slot_indices(self, start: int, end: int, page_size: int) -> list[int]:
        """Device token slots of token positions ``[start, end)`` of this request."""
        pages = self.device_pages
        return [pages[i // page_size] * page_size + i % page_size for i in range(start, end)]

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until local layer ``layer`` of the cached prefix is on the device."""
        for t in self.loads:
            t.wait_until(layer, timeout)
