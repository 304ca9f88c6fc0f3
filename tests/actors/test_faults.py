"""The rank's fault hooks: what can be injected, and what an injected raise touches."""

from __future__ import annotations

import pytest

from actors.faults import FaultHooks, RankFault


@pytest.mark.parametrize(
    ("fault", "problem"),
    [
        (RankFault(kind="explode"), "unknown fault kind"),  # type: ignore[arg-type]
        (RankFault(kind="crash", phase="sample"), "unknown phase"),  # type: ignore[arg-type]
        (RankFault(kind="raise", phase="decode"), "names a request id"),
        (RankFault.raise_for("r", "admit"), "names a request id"),
        (RankFault.pause(-1), "outside"),
        (RankFault.pause(float("nan")), "outside"),
    ],
)
def test_a_fault_that_cannot_be_injected_is_refused(fault: RankFault, problem: str) -> None:
    hooks = FaultHooks(rank=1)
    with pytest.raises(ValueError, match=problem):
        hooks.add(fault)
    hooks.on_phase("decode", "r")  # nothing was injected


def test_an_injected_raise_hits_only_its_request_at_its_phase() -> None:
    hooks = FaultHooks(rank=0)
    hooks.add(RankFault.raise_for("poison", "decode"))
    hooks.on_phase("prefill", "poison")
    hooks.on_phase("decode", "other")
    with pytest.raises(ValueError, match="injected failure of poison at decode"):
        hooks.on_phase("decode", "poison")


def test_a_pause_is_taken_once() -> None:
    hooks = FaultHooks(rank=0)
    hooks.add(RankFault.pause(0.001))
    hooks.before_step()
    assert hooks.pending_pause_s == 0.0
