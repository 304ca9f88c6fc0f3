"""The hierarchical radix tree, its nodes and write policies."""

from hicache_ray.cache.tree.node import (
    SILENT,
    BackupMark,
    InsertResult,
    MatchResult,
    Pending,
    Tier,
    TierObserver,
    TreeNode,
)
from hicache_ray.cache.tree.node_hashes import node_page_hashes
from hicache_ray.cache.tree.policies import WriteRule, write_rule
from hicache_ray.cache.tree.radix_tree import HiRadixTree

__all__ = [
    "SILENT",
    "BackupMark",
    "HiRadixTree",
    "InsertResult",
    "MatchResult",
    "Pending",
    "Tier",
    "TierObserver",
    "TreeNode",
    "WriteRule",
    "node_page_hashes",
    "write_rule",
]
