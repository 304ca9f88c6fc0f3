"""Random interleavings of admissions, steps, takes, cancellations and storage faults.

Prompts share prefixes (so refills land under cached nodes, duplicates appear, and pools
fill up); some were stored in L3 by an earlier deployment; reads fail at random. Every take
checks the KV of every cached page; every step keeps the page accounting exact.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache_ray.base.storage_config import Fault
from hicache_ray.cache.controller import Arrival
from hicache_ray.cache.handle import CacheFullError
from hicache_ray.storage import MemoryObjects
from tests.conftest import make_kv
from tests.controller.helpers import (
    PAGE,
    check_pages,
    controller_config,
    drain,
    fill_pages,
    make_controller,
    prompt,
)
from tests.controller.test_pipelines import stored

KV = make_kv(page_size=PAGE)
BASES = [prompt(seed, 40) for seed in range(3)]
_STORE = MemoryObjects()
for _base in BASES[:2]:
    stored(_STORE, _base)


class ControllerMachine(RuleBasedStateMachine):
    policy = "wait_complete"
    write_policy = "write_through"

    @initialize()
    def setup(self) -> None:
        config = controller_config(
            device_tokens=64,
            prefetch_policy=self.policy,
            write_policy=self.write_policy,
            threshold_tokens=8,
        )
        flaky = Fault(op="read", kind="fail", probability=0.15)
        store = MemoryObjects()  # each example starts from the same stored prompts
        store._objects.update(_STORE._objects)
        self.ctl = make_controller(config, KV, store, faults=(flaky,))
        self.tokens: dict[str, list[int]] = {}
        self.ids = itertools.count()

    def teardown(self) -> None:
        if hasattr(self, "ctl"):
            for rid in list(self.ctl.known):
                self.ctl.cancel(rid)
            drain(self.ctl)
            self.ctl.check_integrity()
            self.ctl.close()

    @precondition(lambda self: len(self.tokens) < 3)
    @rule(base=st.integers(0, 2), cut=st.integers(1, 40), tail=st.integers(0, 9))
    def admit(self, base: int, cut: int, tail: int) -> None:
        rid = f"q{next(self.ids)}"
        tokens = BASES[base][:cut] + prompt(100 + tail, tail)
        self.tokens[rid] = tokens
        self.ctl.step([Arrival(rid, tokens)])

    @rule(settle=st.booleans())
    def step(self, settle: bool) -> None:
        if settle:
            self.ctl.settle(timeout=30)
        self.ctl.step()

    @precondition(lambda self: self.tokens)
    @rule(commit=st.booleans())
    def serve(self, commit: bool) -> None:
        """Step until the oldest request may run (a FIFO scheduler), then run it.

        Only the cached length depends on thread timing, never which request runs, so
        every example replays the same rules.
        """
        rid = next(iter(self.tokens))
        result = self.ctl.step()
        while rid not in result.runnable:
            self.ctl.settle(timeout=30)
            result = self.ctl.step()
        tokens = self.tokens.pop(rid)
        handle = self.ctl.take(rid)
        self.ctl.wait_ready(handle, timeout=30)
        cached = handle.num_cached_tokens // PAGE
        check_pages(self.ctl, handle, tokens, cached)
        if not commit:
            self.ctl.release(handle)
            return
        try:
            self.ctl.reserve(handle, len(tokens) - handle.num_cached_tokens)
        except CacheFullError:
            self.ctl.release(handle)
            return
        fill_pages(self.ctl, handle, tokens, cached)
        self.ctl.finish(handle, tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rids = list(self.tokens)
        rid = rids[data.draw(st.integers(0, len(rids) - 1))]
        with contextlib.suppress(Exception):  # taken already: nothing to cancel
            self.ctl.cancel(rid)
        self.tokens.pop(rid)

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "ctl"):
            self.ctl.check_integrity()
            assert list(self.ctl.known) == list(self.tokens), "admitted requests"


@pytest.mark.parametrize(
    ("policy", "write_policy"),
    [
        ("wait_complete", "write_through"),
        ("best_effort", "write_back"),
        ("timeout", "write_through_selective"),
    ],
)
def test_random_controller_interleavings(policy: str, write_policy: str) -> None:
    machine = type(
        f"Machine_{policy}_{write_policy}",
        (ControllerMachine,),
        {"policy": policy, "write_policy": write_policy},
    )
    machine.TestCase.settings = settings(  # type: ignore[attr-defined]
        max_examples=15,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()  # type: ignore[attr-defined]
