"""Write policies: when a device node is copied to the host pool.

    policy                    copied when                          on eviction from L1
    ------------------------  -----------------------------------  ------------------------
    write_through             inserted (threshold 1)               already on host
    write_through_selective   hit count reaches the threshold (2)  dropped if not on host
    write_back                never before eviction                copied, then dropped

A node's hit count starts at 1 on insert and grows by one per match that reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_ray.base.config import WriteConfig
from hicache_ray.cache.tree.node import TreeNode

__all__ = ["WriteRule", "write_rule"]


@dataclass(frozen=True)
class WriteRule:
    """The decision a write policy makes for one node."""

    name: str
    hit_threshold: int
    on_evict: bool

    def wants_write(self, node: TreeNode) -> bool:
        """True when ``node`` is on the device, has no host copy, and is hot enough."""
        return (
            not self.on_evict
            and node.device_pages is not None
            and node.host_pages is None
            and node.hit_count >= self.hit_threshold
        )


_RULES = {
    "write_through": lambda t: WriteRule("write_through", t, on_evict=False),
    "write_through_selective": lambda t: WriteRule("write_through_selective", t, on_evict=False),
    "write_back": lambda t: WriteRule("write_back", t, on_evict=True),
}


def write_rule(config: WriteConfig) -> WriteRule:
    """The rule for a validated write config."""
    return _RULES[config.policy](config.effective_threshold)
