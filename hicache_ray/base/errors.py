"""Exceptions shared across the package."""

from __future__ import annotations

__all__ = [
    "AllocatorError",
    "CollectiveError",
    "ConfigError",
    "HiCacheError",
    "TransferError",
]


class HiCacheError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(HiCacheError, ValueError):
    """An invalid setting: the message names the field, the value and the fix."""

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        super().__init__(f"{field}={value!r}: {problem}; {fix}")
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, object, str, str]]:
        # Rebuilt from its fields when it crosses processes (Ray re-raises it on the caller).
        return type(self), (self.field, self.value, self.problem, self.fix)


class AllocatorError(HiCacheError, RuntimeError):
    """A page was freed twice, or handed out while already in use (accounting is broken)."""


class TransferError(HiCacheError, RuntimeError):
    """A copy between tiers failed; the pages it touched hold no valid KV."""


class CollectiveError(HiCacheError, RuntimeError):
    """A collective between the ranks failed (timeout, dead peer, mismatched calls): the
    group is broken and the deployment must be re-formed. Every other exception raised
    while running a request is that request's own failure."""
