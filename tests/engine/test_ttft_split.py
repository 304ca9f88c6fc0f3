"""Where an L3 hit's time to first token goes: a known cost injected into one part lands in
that part (the rank's clock; the caller's part is tested on a deployment in
tests/actors/test_deployment.py). Each injected cost is 0.2 s: far above what any other
part of these tiny requests takes, so the checks hold on a loaded machine."""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from hicache_ray.base.storage_config import Fault
from hicache_ray.engine.request import GenerateRequest, TTFTSplit
from hicache_ray.storage import MemoryObjects
from tests.engine.test_runtime import drain, prompt, run, runtime

DELAY_S = 0.2


def _l3_hit(faults: tuple[Fault, ...]) -> TTFTSplit:
    """The split of a request whose 40-token prefix only L3 holds."""
    objects = MemoryObjects()
    writer = runtime(objects)
    base = prompt(1, 40)
    run(writer, GenerateRequest("a", base, 2))
    drain(writer)
    writer.ctl.close()
    reader = runtime(objects, faults=faults)
    result = run(reader, GenerateRequest("b", base + prompt(2, 6), 2))
    reader.ctl.close()
    assert result.storage_hit_tokens > 0 and result.error is None, result
    split = result.ttft_split
    assert abs(split.rank_s - result.ttft_s) < 1e-6, split
    assert min(msgspec.structs.astuple(split)) >= 0, split
    return split


def _largest_but_forward(split: TTFTSplit) -> str:
    parts = msgspec.structs.asdict(split)
    del parts["forward_s"]
    return max(parts, key=parts.__getitem__)


def test_a_slow_store_read_lands_in_prefetch() -> None:
    split = _l3_hit((Fault(op="read", kind="delay", delay_s=DELAY_S),))
    assert split.prefetch_s >= DELAY_S, split
    assert _largest_but_forward(split) == "prefetch_s", split


def test_a_slow_store_lookup_lands_in_query() -> None:
    split = _l3_hit((Fault(op="size", kind="delay", delay_s=DELAY_S),))
    assert split.query_s >= DELAY_S, split
    assert _largest_but_forward(split) == "query_s", split


def test_a_slow_agreement_lands_in_agreement() -> None:
    rt = runtime(None)
    consensus = rt.ctl.consensus
    agree = consensus.all_reduce_min

    def slow(values: Sequence[int], step: int) -> list[int]:
        time.sleep(DELAY_S)  # the injected cost: a slow collective
        return agree(values, step)

    consensus.all_reduce_min = slow  # type: ignore[method-assign]
    result = run(rt, GenerateRequest("a", prompt(3, 12), 2))
    rt.ctl.close()
    split = result.ttft_split
    assert split.agreement_s >= DELAY_S, split
    assert _largest_but_forward(split) == "agreement_s", split
    assert abs(split.rank_s - result.ttft_s) < 1e-6, split


def test_rank_0s_look_ahead_lands_in_the_admitting_step_not_the_queue() -> None:
    rt = runtime(MemoryObjects())
    lookups = rt.look_ahead._lookups

    class Slow:
        def look_ahead_start(self, key: bytes, salt: str) -> int:
            time.sleep(DELAY_S)  # the injected cost: a slow look-ahead before the rounds
            return lookups.look_ahead_start(key, salt)

        def look_ahead_from(self, key: bytes, salt: str, start: int) -> bool:
            return lookups.look_ahead_from(key, salt, start)

    rt.look_ahead._lookups = Slow()
    result = run(rt, GenerateRequest("a", prompt(4, 12), 2))
    rt.ctl.close()
    split = result.ttft_split
    assert split.agreement_s >= DELAY_S and split.queue_s < DELAY_S, split
    assert _largest_but_forward(split) == "agreement_s", split
