"""The request table (rank 0's admission queue) and batch planning, without a model."""

from __future__ import annotations

from hicache_ray.engine.request import ErrorKind, GenerateRequest, SamplingParams
from hicache_ray.engine.sampling import RequestSampler
from hicache_ray.engine.scheduler import Phase, RankRequest, RequestTable, plan_batch


def _request(rid: str, prompt: int, max_new: int = 4) -> RankRequest:
    request = GenerateRequest(rid, list(range(prompt)), max_new)
    return RankRequest(request, RequestSampler(rid, SamplingParams()), 0.0)


def test_admission_is_fifo_within_the_pool_budget() -> None:
    table = RequestTable(num_pages=9, page_size=4, max_queued=8)
    for rid, prompt in (("a", 12), ("b", 12), ("c", 4), ("d", 4)):  # 4, 4, 2, 2 pages
        assert table.offer(_request(rid, prompt)) is None
    assert [r.rid for r in table.admit()] == ["a", "b"]  # c would fit, but waits: FIFO
    assert table.num_queued == 2 and not table.ready()
    assert table.end("a") is not None
    assert table.ready() and [r.rid for r in table.admit()] == ["c", "d"]
    assert len(table) == 3 and table.admit() == []


def test_past_max_queued_a_request_is_refused_as_overloaded() -> None:
    table = RequestTable(num_pages=4, page_size=4, max_queued=2)
    assert table.offer(_request("a", 8)) is None
    assert table.offer(_request("b", 8)) is None
    refused = table.offer(_request("c", 8))
    assert refused is not None and refused.error_kind is ErrorKind.OVERLOADED
    assert refused.error is not None and "max_queued=2" in refused.error
    table.admit()  # "a" leaves the queue: room for one more
    assert table.offer(_request("c", 8)) is None
    twice = table.offer(_request("c", 8))
    assert twice is not None and twice.error is not None and twice.error.startswith("rid: ")


def test_a_queued_request_can_be_withdrawn() -> None:
    table = RequestTable(num_pages=1, page_size=4, max_queued=4)
    table.offer(_request("a", 4))
    record = table.get("a")
    assert record is not None and record.phase is Phase.QUEUED
    assert table.withdraw("a") and not table.withdraw("a") and "a" not in table


def test_a_record_walks_the_phases_and_leaves_the_table_once() -> None:
    table = RequestTable(num_pages=8, page_size=4, max_queued=4)
    record = _request("a", 8)
    table.offer(record)
    table.admit()
    assert not table.withdraw("a")  # admitted: no longer withdrawn from the queue
    claim = object()
    table.arrive(record, claim, now=1.0)  # type: ignore[arg-type]
    assert record.phase is Phase.ADMITTED and table.claims() == [claim]
    table.start(record, handle=object())  # type: ignore[arg-type]
    assert record.phase is Phase.RUNNING and table.running == [record] and table.claims() == []
    assert table.end("a") is record and table.end("a") is None and len(table) == 0
    assert table.ready() is False and table.offer(_request("b", 28)) is None
    assert table.ready()  # the whole pool is free again


def _req(rid: str, prompt: int, max_new: int, computed: int = 0, generated: int = 0) -> RankRequest:
    r = _request(rid, prompt, max_new)
    r.computed, r.generated = computed, list(range(generated))
    return r


def test_decodes_come_first_and_prefills_share_the_rest_of_the_budget() -> None:
    decoding = [_req(f"d{i}", 8, 10, computed=8, generated=1) for i in range(3)]
    long, short = _req("long", 100, 4), _req("short", 20, 4)
    batch = plan_batch([long, *decoding, short], max_step_tokens=50)
    assert [(r.rid, n) for r, n in batch] == [
        ("long", 47),  # prefills get what the three decodes leave, oldest first
        ("d0", 1),
        ("d1", 1),
        ("d2", 1),
    ]
    long.computed = 94
    batch = plan_batch([long, *decoding, short], max_step_tokens=50)
    assert (batch[0][0].rid, batch[0][1]) == ("long", 6)
    assert ("short", 20) in [(r.rid, n) for r, n in batch]  # a chunk after another's end


def test_a_prefill_always_progresses_and_finished_requests_are_left_out() -> None:
    decoding = [_req(f"d{i}", 4, 10, computed=4, generated=1) for i in range(8)]
    waiting = _req("p", 16, 2)
    done = _req("done", 4, 2, computed=5, generated=2)
    batch = plan_batch([*decoding, waiting, done], max_step_tokens=4)
    assert ("p", 1) in [(r.rid, n) for r, n in batch]
    assert "done" not in [r.rid for r, _ in batch]


def test_what_a_request_computes_and_when_it_samples() -> None:
    r = _req("r", 10, 3)
    assert r.next_tokens(4) == [0, 1, 2, 3] and not r.samples_after(4)
    r.computed = 8
    assert r.next_tokens(4) == [8, 9] and r.samples_after(2)
    r.computed, r.generated = 10, [42]
    assert r.prefilled and r.next_tokens(1) == [42] and r.samples_after(1)
    r.stop_ids = frozenset({42})
    assert r.done and r.finish_reason == "stop"
    silent = _req("s", 10, 0, computed=10)
    assert not silent.samples_after(0) and silent.done and silent.finish_reason == "length"
