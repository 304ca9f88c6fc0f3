"""Faults a test or ``bench faults`` injects into a rank: the one object that holds them.

A rank has no fault hooks until :meth:`~actors.rank.RankActor.inject` is called; in
production nothing is injected and the step loop checks one ``None``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

import msgspec

__all__ = ["FaultHooks", "Phase", "RankFault"]

log = logging.getLogger(__name__)

Phase = Literal["admit", "prefill", "decode"]


class RankFault(msgspec.Struct, frozen=True, kw_only=True):
    """One injected fault (build it with :meth:`pause`, :meth:`crash` or :meth:`raise_for`).

    Attributes:
        kind: ``pause`` (the step thread stalls ``seconds`` before its next step, as a hung
            rank would), ``crash`` (the process exits the next time a step reaches
            ``phase``) or ``raise`` (running request ``rid`` at ``phase`` raises, as a
            request that breaks the model code would).
        phase: ``admit`` (requests agreed, prefetches started), ``prefill`` or ``decode``.
    """

    kind: Literal["pause", "crash", "raise"]
    seconds: float = 0.0
    phase: Phase = "prefill"
    rid: str = ""

    @classmethod
    def pause(cls, seconds: float) -> RankFault:
        return cls(kind="pause", seconds=seconds)

    @classmethod
    def crash(cls, phase: Phase) -> RankFault:
        return cls(kind="crash", phase=phase)

    @classmethod
    def raise_for(cls, rid: str, phase: Phase = "prefill") -> RankFault:
        return cls(kind="raise", rid=rid, phase=phase)

    def check(self) -> None:
        """Raise ``ValueError`` for a fault that cannot be injected."""
        if self.kind not in ("pause", "crash", "raise"):
            raise ValueError(f"unknown fault kind {self.kind!r}")
        if self.phase not in ("admit", "prefill", "decode"):
            raise ValueError(f"unknown phase {self.phase!r}")
        if self.kind == "raise" and (self.phase == "admit" or not self.rid):
            raise ValueError("a raise fault names a request id and prefill or decode")
        if not 0 <= self.seconds <= 3600:
            raise ValueError(f"pause of {self.seconds} s is outside [0, 3600]")


class FaultHooks:
    """The faults injected into one rank: a pause before the next step, and at most one
    phase fault (a later one replaces it)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._pause_s = 0.0
        self._phase_fault: RankFault | None = None

    def add(self, fault: RankFault) -> None:
        fault.check()
        if fault.kind == "pause":
            self._pause_s = fault.seconds
        else:
            self._phase_fault = fault

    @property
    def pending_pause_s(self) -> float:
        """Seconds of pause the next step will take (0: none)."""
        return self._pause_s

    def before_step(self) -> None:
        """The step thread, before a step: stall once for an injected pause."""
        if self._pause_s:
            pause, self._pause_s = self._pause_s, 0.0
            time.sleep(pause)

    def on_phase(self, reached: str, rid: str) -> None:
        """The runtime's phase hook: crash or raise where the injected fault says."""
        fault = self._phase_fault
        if fault is None or reached != fault.phase:
            return
        if fault.kind == "crash":
            log.error("rank %d: crashing at %s (fault injection)", self.rank, reached)
            os._exit(1)
        if rid == fault.rid:
            raise ValueError(f"injected failure of {rid} at {reached}")
