"""Prefill and decode apart: when a request goes to the prefill side, and how long decode
waits for its pages.

A split pays when the prompt's uncached part is long (the decode side would otherwise stall
its running decodes on a long prefill) and the prefill side has room; a short or mostly
cached prompt is cheaper prefilled where it decodes (the handoff through L3 costs about
what an L3 hit costs). :func:`decide` makes that choice per request from what the caller
knows: the prompt's length, what the decode side already holds of it (its L1, L2 and the
shared L3, from the cache events), and the uncached tokens already sent to the prefill side.
With several prefill replicas, :func:`pick_prefill` chooses the one that would finish the
prompt first: what it would compute of it (the prompt less what it holds in L1 and L2; L3
is the same for every replica) after the uncached tokens already sent to it.

The handoff wait is bounded: :meth:`SplitPolicy.wait_s` is how long decode waits for the
prefill side to compute the prompt and back it up to L3. Past it (or when prefill fails),
decode computes whatever L3 does not hold: a late or lost prefill costs time, never a
wrong token (decode uses only pages whose checksums verify).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from hicache_ray.base.checks import check_types
from hicache_ray.base.errors import ConfigError

__all__ = ["MAX_PREFILL_REPLICAS", "Decision", "Reason", "SplitPolicy", "decide", "pick_prefill"]

MAX_PREFILL_REPLICAS = 64  # prefill deployments one pair may have


class Reason(enum.Enum):
    """Why a request was or was not split."""

    SPLIT = "split"  # long uncached part, room on the prefill side
    SHORT = "short"  # its uncached part is below min_uncached_tokens
    CACHED = "cached"  # decode holds too much of it (the uncached share is below the floor)
    BUSY = "busy"  # the prefill side has max_inflight_tokens or more to compute
    OFF = "off"  # splitting is off (``enabled`` False)


class SplitPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """When a request is prefilled apart, and how long decode waits for it.

    Attributes:
        enabled: False sends every request to the decode side (which prefills it itself).
        min_uncached_tokens: split only when at least this many prompt tokens are not
            cached on the decode side (short prompts lose more to the handoff than they
            save). ``bench pd --sweep`` measured the handoff at 14-28 % of TTFT up to
            1,024 uncached tokens and 7-8 % from 2,048 on (2 cores, ``bench`` model).
        min_uncached_share: and only when they are at least this share of the prompt, in
            ``[0, 1]`` (a mostly cached prompt is a cheap prefill where it decodes: the
            prefill side reads the cached part from L3 first). Measured the same way: a
            split cost 11-15 % more TTFT at a share of 0.25, at most 6 % from 0.5 on.
        max_inflight_tokens: the prefill side is saturated while the uncached tokens of the
            requests sent to it and not yet handed off reach this; a request that would
            pass it is prefilled on the decode side instead. An idle prefill side takes
            any request that passes the other tests. ``bench pd --sweep`` measured both
            bounds: every prompt turned away stalls the decode side's streams for its
            whole prefill (p99 gap 2.2-3.1 s against 95-104 ms with a burst of 8 x 2,048
            tokens all apart), so the cap should hold the bursts expected; and the queue
            it allows should drain within ``wait_max_s`` (32,768 tokens: 29-33 s on one
            core of 2).
        wait_base_s / wait_per_1k_s / wait_max_s: decode waits for the prefill side (its
            prefill and the backup of the prompt's pages to L3) ``wait_base_s`` plus
            ``wait_per_1k_s`` per 1,024 uncached tokens it has to compute first (the
            request's and those sent before it), at most ``wait_max_s``; then it computes
            what L3 does not hold. A prefill side measured slower than ``wait_per_1k_s / 2``
            per 1,024 tokens is given twice its measured pace instead. Once the prefill
            side has answered, its backup gets at least ``wait_base_s`` more.
        poll_s: how often the caller reads the prefill side's cache events while a
            handoff waits (the L3 pages it backed up).
    """

    enabled: bool = True
    min_uncached_tokens: int = 2048
    min_uncached_share: float = 0.5
    max_inflight_tokens: int = 32768
    wait_base_s: float = 5.0
    wait_per_1k_s: float = 2.0
    wait_max_s: float = 120.0
    poll_s: float = 0.005

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("min_uncached_tokens", "max_inflight_tokens"):
            if not 0 <= getattr(self, name) <= 1 << 30:
                raise ConfigError(name, getattr(self, name), "outside [0, 2**30]", "use tokens")
        if not 0.0 <= self.min_uncached_share <= 1.0:
            raise ConfigError(
                "min_uncached_share", self.min_uncached_share, "outside [0, 1]", "use a share"
            )
        for name in ("wait_base_s", "wait_per_1k_s", "wait_max_s"):
            if not 0.0 <= getattr(self, name) <= 3600.0:
                raise ConfigError(name, getattr(self, name), "outside [0, 3600]", "use seconds")
        if not 0.0005 <= self.poll_s <= 1.0:
            raise ConfigError("poll_s", self.poll_s, "outside [0.0005, 1]", "use 0.005")

    def wait_s(self, tokens: int, observed_per_1k_s: float = 0.0) -> float:
        """How long decode waits for a handoff when the prefill side has ``tokens`` to
        compute before it is done (its own and those ahead of it), and has lately taken
        ``observed_per_1k_s`` per 1,024 (a slow side is given twice its pace)."""
        per_1k = max(self.wait_per_1k_s, 2.0 * observed_per_1k_s)
        return min(self.wait_max_s, self.wait_base_s + per_1k * tokens / 1024)


@dataclass(frozen=True)
class Decision:
    """One request's choice: ``split`` (prefilled apart), why, and its uncached tokens."""

    split: bool
    reason: Reason
    uncached_tokens: int


def decide(
    policy: SplitPolicy, prompt_tokens: int, cached_tokens: int, inflight_tokens: int
) -> Decision:
    """Whether a prompt of ``prompt_tokens``, of which the decode side holds
    ``cached_tokens`` (any tier), goes to the prefill side, which has ``inflight_tokens``
    uncached tokens to compute already."""
    if prompt_tokens <= 0 or cached_tokens < 0 or inflight_tokens < 0:
        raise ValueError(
            f"counts must be >= 0 (and the prompt > 0): prompt {prompt_tokens}, "
            f"cached {cached_tokens}, in flight {inflight_tokens}"
        )
    uncached = max(0, prompt_tokens - cached_tokens)
    if not policy.enabled:
        return Decision(False, Reason.OFF, uncached)
    if uncached < max(1, policy.min_uncached_tokens):
        return Decision(False, Reason.SHORT, uncached)
    if uncached < policy.min_uncached_share * prompt_tokens:
        return Decision(False, Reason.CACHED, uncached)
    if inflight_tokens and inflight_tokens + uncached > policy.max_inflight_tokens:
        return Decision(False, Reason.BUSY, uncached)
    return Decision(True, Reason.SPLIT, uncached)


def pick_prefill(prompt_tokens: int, held: Sequence[int], inflight: Sequence[int]) -> int:
    """The prefill replica for a prompt of ``prompt_tokens``: replica ``i`` holds
    ``held[i]`` of its tokens (L1 and L2) and has ``inflight[i]`` uncached tokens to compute
    already; the one with the least to compute before this prompt is done (ties: the least
    loaded, then the first)."""
    if len(held) != len(inflight) or not held:
        raise ValueError(f"one count per replica: held {len(held)}, in flight {len(inflight)}")
    if prompt_tokens <= 0 or min(held) < 0 or min(inflight) < 0:
        raise ValueError(f"counts must be >= 0 (and the prompt > 0): prompt {prompt_tokens}")

    def cost(i: int) -> tuple[int, int, int]:
        todo = max(0, prompt_tokens - held[i])
        return inflight[i] + todo, inflight[i], i

    return min(range(len(held)), key=cost)
