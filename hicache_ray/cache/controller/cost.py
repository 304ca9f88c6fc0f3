"""What an L3 read costs against recomputing the same tokens, as this rank measures both.

A prefetch is worth waiting for only while it is faster than computing its tokens. The
rank learns the rates from its own work: seconds per token of its forward passes (fed by
the engine after each prefill step), seconds per page of its finished L3 reads, and
seconds from admission to an L3 query's answer. With ``prefetch.recompute_guard`` on, the
``timeout`` policy (the default) then

* skips the query of a remainder expected to be computed sooner than the query and its
  reads take (counted as ``l3_queries_skipped_cheaper_to_compute``): the threshold of a
  lookup follows the model and the machine, not a fixed token count,
* skips a read expected to take longer than computing its tokens (the request computes
  them; counted as ``l3_unfulfilled_tokens_slower_than_compute``), and
* cuts a read at the time computing its tokens would take (the pages read by then are
  used), when that is sooner than the configured deadline.

Each rank decides on its own rates; the ranks' MIN agreement keeps the outcome common
(a rank that skips reports no pages read, so every rank recomputes them).
"""

from __future__ import annotations

__all__ = ["CostModel"]

_ALPHA = 0.25  # weight of the newest sample in the moving averages
_MIN_FORWARD_TOKENS = 64  # steps with fewer tokens (decode) say little about prefill
_MIN_WAIT_S = 0.01  # a read is never cut sooner than this after admission


class CostModel:
    """Moving averages of this rank's compute and L3 read rates (step thread only)."""

    def __init__(self) -> None:
        self.s_per_token = 0.0  # 0: not measured yet
        self.s_per_page = 0.0
        self.s_per_query = 0.0

    def note_forward(self, tokens: int, seconds: float) -> None:
        """A forward pass computed ``tokens`` tokens in ``seconds``."""
        if tokens >= _MIN_FORWARD_TOKENS and seconds > 0:
            self.s_per_token = _average(self.s_per_token, seconds / tokens)

    def note_read(self, pages: int, seconds: float) -> None:
        """An L3 read of ``pages`` pages took ``seconds`` (start to end)."""
        if pages > 0 and seconds > 0:
            self.s_per_page = _average(self.s_per_page, seconds / pages)

    def note_query(self, seconds: float) -> None:
        """An L3 query answered ``seconds`` after its request's admission."""
        if seconds > 0:
            self.s_per_query = _average(self.s_per_query, seconds)

    def worth_querying(self, pages: int, tokens: int) -> bool:
        """Whether looking ``pages`` up in L3 and reading them (should it hold them all) is
        expected to beat computing their ``tokens`` (yes while a rate is unmeasured)."""
        if not self.s_per_token or not self.s_per_query:
            return True
        return self.s_per_query + pages * self.s_per_page <= tokens * self.s_per_token

    def worth_reading(self, pages: int, tokens: int) -> bool:
        """Whether reading ``pages`` is expected to beat computing their ``tokens`` (yes
        while either rate is unmeasured)."""
        if not self.s_per_token or not self.s_per_page:
            return True
        return pages * self.s_per_page <= tokens * self.s_per_token

    def wait_s(self, tokens: int, configured_s: float) -> float:
        """How long a read of ``tokens`` tokens may keep its request waiting: the configured
        deadline, or the time computing them takes when that is sooner."""
        if not self.s_per_token:
            return configured_s
        return min(configured_s, max(_MIN_WAIT_S, tokens * self.s_per_token))


def _average(current: float, sample: float) -> float:
    return sample if not current else (1 - _ALPHA) * current + _ALPHA * sample
