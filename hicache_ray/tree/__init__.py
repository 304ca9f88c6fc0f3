"""The hierarchical radix tree, its nodes and write policies."""

from hicache_ray.tree.node import (
    SILENT,
    BackupMark,
    MatchResult,
    Pending,
    Tier,
    TierObserver,
    TreeNode,
)
from hicache_ray.tree.policies import WriteRule, write_rule
from hicache_ray.tree.radix_tree import HiRadixTree, InsertResult

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
    "write_rule",
]
