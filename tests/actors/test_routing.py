"""Two replicas behind the cache router: every conversation's next turn reaches the replica
whose L1 holds its history (no L3 here, so only that replica can serve it from cache), and
after that replica's ranks re-form (their cache gone) turns still succeed; the ranking
itself on fake replicas (hits per tier, load, no information)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import urllib.request
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from hicache_ray.base.errors import ConfigError
from hicache_ray.keys import page_hashes
from hicache_ray.serving.serve_options import serve_ingresses, serve_replicas
from tests.actors.router_follower import Follower
from tests.helpers import ensure_local_ray, wait_until

ray = pytest.importorskip("ray")

PAGE = 4
PAGES = 12  # pages of each first turn the copy test sends
LONG = 1800  # tokens of an answer that replicas are killed in the middle of (L1: 2,048)


def test_bad_replica_options_are_refused() -> None:
    assert serve_replicas({}) == (1, "cache", {})
    weights = {"route_weights": "l1=2, load=0.5, l3=0.7"}
    assert serve_replicas({"replicas": "3", "router": "prefix", **weights}) == (
        3,
        "prefix",
        {"l1": 2.0, "load": 0.5, "l3": 0.7},
    )
    bad_options = [
        {"replicas": "0"},
        {"replicas": "two"},
        {"router": "random"},
        {"route_weights": "queued=64"},
        {"route_weights": "room=-0.1"},
        {"route_weights": "l1=-1"},
        {"route_weights": "l1=x"},
    ]
    for bad in bad_options:
        with pytest.raises(ConfigError, match=r"replicas|router|route_weights"):
            serve_replicas(bad)
    assert serve_ingresses({}) == 1 and serve_ingresses({"ingresses": "3"}) == 3
    for count in ("0", "65", "two"):
        with pytest.raises(ConfigError, match="ingresses"):
            serve_ingresses({"ingresses": count})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_replicas() -> Iterator[int]:
    from ray import serve

    from actors.openai_app import build_app

    ensure_local_ray()
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": "tiny4",
        "storage": "none",
        "device_tokens": "2048",
        "page_size": str(PAGE),
        "replicas": "2",
        "router": "cache",
        "route_weights": "wait_s=30",  # a loaded 2-core machine may answer late: no pow2
    }
    try:
        serve.run(build_app(args), name="routed", route_prefix="/")
        yield port
    finally:
        serve.shutdown()


def _complete(port: int, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    body = json.dumps({"model": "tiny4", "prompt": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_next_turn_reaches_the_replica_that_holds_its_history(
    ray_local: None, two_replicas: int
) -> None:
    port = two_replicas
    turns = _spread(port, [[(7 * c + i) % 200 + 1 for i in range(10 * PAGE)] for c in range(18)])
    index = _index()
    holders = _holders(index, turns)
    for _ in range(2):  # later turns, one at a time: each history is on one replica only
        for c, prompt in enumerate(turns):
            turns[c] = prompt + [(c + len(prompt)) % 200 + 1 for _ in range(2 * PAGE)]
            answer = _complete(port, turns[c])
            assert _cached(answer) >= len(prompt) // PAGE * PAGE - PAGE, (c, answer["usage"])
            served_by = answer["usage"]["prompt_tokens_details"]["hicache"]["replica"]
            assert served_by == holders[c]  # the answer names the replica that served it
    # Rank 0 of a replica holding several conversations dies: the index forgets the replica's
    # pages at once (down), the replica re-forms on its own (empty caches, a new journal) and
    # comes back; the next turn of one of its conversations recomputes its history wherever
    # it goes, and the other replica keeps routing its own.
    held = _holders(index, turns)
    lost = max(set(held.values()), key=list(held.values()).count)  # 6 over 2: 3 or more
    first, *others = sorted(c for c, r in held.items() if r == lost)
    name = f"hicache-openai-{os.getpid()}-{lost}-g0-rank0"
    ray.kill(ray.get_actor(name, namespace="hicache"), no_restart=True)
    lost_turns = [turns[c] for c in [first, *others]]
    wait_until(partial(_forgot, index, lost, lost_turns), 60, "the replica's pages forgotten")
    wait_until(partial(_journal, index, lost), 120, "the replica re-formed with no call")
    answer = _complete(port, turns[first] + [1] * PAGE)
    assert _cached(answer) == 0  # its history went with the ranks
    kept = {c for c, r in _holders(index, turns).items() if r != lost}
    assert kept, "the other replica holds its conversations"
    for c in sorted(kept):
        answer = _complete(port, turns[c] + [2] * PAGE)
        assert _cached(answer) >= len(turns[c]) // PAGE * PAGE - PAGE, (c, answer["usage"])


def _index() -> Any:
    """The application's index, which the router made (never made here)."""
    from actors.index_actor import find_index

    index = find_index(f"openai-{os.getpid()}")
    assert index is not None, "no router made the index"
    return index


def _engine_replicas() -> list[Any]:
    """The Serve actors of the app's engine replicas."""
    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::routed#hicache-engine#")
    ]


def test_engine_replicas_killed_mid_call_lose_neither_the_call_nor_the_index(
    ray_local: None, two_replicas: int
) -> None:
    """Both engine replicas are killed while one answers a call: the ingress sends the call
    again (to a replacement, once one runs) and it is answered in full; the index, which the
    router's process made (not a replica's publisher), still answers and learns the
    replacements."""
    port, prompt = two_replicas, [(13 * i) % 200 + 1 for i in range(8 * PAGE)]
    _complete(port, prompt)
    index = _index()
    old = ray.get(index.replicas.remote())
    killed = _engine_replicas()
    assert len(killed) == 2
    ranks = [  # rank 0 of each replica, whatever generation it re-formed to
        ray.get_actor(name, namespace="hicache") for name in _live_ranks() if "rank0" in name
    ]
    assert len(ranks) == 2

    def busy() -> int:  # replicas with a request (or background work) in flight
        return sum(not idle for idle in ray.get([r.idle.remote() for r in ranks]))

    wait_until(lambda: busy() == 0, 60, "both replicas idle")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(_complete, port, prompt + [3] * PAGE, LONG)
        wait_until(lambda: busy() > 0, 60, "the call running")  # decoding outlasts the kill
        for replica in killed:
            ray.kill(replica, no_restart=True)
        answer = call.result(timeout=300)
    assert answer["usage"]["completion_tokens"] == LONG
    assert answer["usage"]["prompt_tokens_details"]["hicache"]["replica"] not in old
    assert ray.get(index.size.remote(), timeout=30) >= 0  # the same actor, alive

    def learned() -> bool:
        replicas = set(ray.get(index.replicas.remote()))
        return len(replicas) == 2 and not replicas & set(old)

    wait_until(learned, 120, "the replacements in the index, the killed ones gone")


def _stream_lines(port: int, prompt: list[int], max_tokens: int) -> Iterator[str]:
    """The ``data:`` payloads of one streamed completion, as they arrive."""
    body = {"model": "tiny4", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: "):
                yield line.removeprefix("data: ")


def _live_ranks() -> set[str]:
    """The rank actors of this app's engine replicas now alive."""
    prefix = f"hicache-openai-{os.getpid()}-"
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == "hicache" and a["name"].startswith(prefix)
    }


def test_a_stream_behind_the_ingress_survives_its_replicas_rank_killed(
    ray_local: None, two_replicas: int
) -> None:
    """Both replicas' ranks die while a stream is decoding: the ingress's stream goes on
    (its replica re-forms and replays it) and carries exactly the full answer."""
    port, max_tokens = two_replicas, 400  # decoding outlasts the kill by seconds
    prompt = [(11 * i) % 200 + 1 for i in range(6 * PAGE)]
    expected = _complete(port, prompt, max_tokens)["choices"][0]["text"]
    before = _live_ranks()
    text, done, killed = "", False, False
    for payload in _stream_lines(port, prompt, max_tokens):
        if payload == "[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        assert "error" not in chunk, chunk
        text += "".join(c["text"] for c in chunk["choices"])
        if text and not killed:
            for name in before:
                ray.kill(ray.get_actor(name, namespace="hicache"), no_restart=True)
            killed = True
    assert done and killed
    assert text == expected
    # Nothing else ran: new ranks mean the stream's replica re-formed while it streamed.
    after = _live_ranks()
    assert after and after.isdisjoint(before)


def _journal(index: Any, replica: str) -> bool:
    """The index follows a journal of ``replica``'s (it is not down: its ranks answer)."""
    epoch, _ = ray.get(index.position.remote(replica))
    return bool(epoch)


def _forgot(index: Any, replica: str, turns: list[list[int]]) -> bool:
    """The index holds nothing of ``replica``'s old conversations (it re-formed)."""
    return all(
        ray.get(index.hits.remote([replica], page_hashes(p, PAGE)))[replica].device < 2
        for p in turns
    )


def _all_held(index: Any, turns: list[list[int]]) -> bool:
    return len(_holders(index, turns)) == len(turns)


def _holders(index: Any, turns: list[list[int]]) -> dict[int, str]:
    """Conversation -> the replica whose L1 holds its whole prompt, as the router sees it."""
    replicas = ray.get(index.replicas.remote())
    out = {}
    for c, prompt in enumerate(turns):
        hits = ray.get(index.hits.remote(replicas, page_hashes(prompt, PAGE)))
        full = [r for r, h in hits.items() if h.device >= len(prompt) // PAGE]
        if full:
            out[c] = full[0]
    return out


def test_a_replica_silent_for_long_is_forgotten_by_the_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica killed without a goodbye stops asking its position (the publisher's
    heartbeat); after ``SILENT_S`` its pages leave the index."""
    from actors.index_actor import SILENT_S, IndexActor
    from hicache_ray.cache.events import BlockStored, EventBatch, KVEventBatch

    now = [100.0]
    monkeypatch.setattr("actors.index_actor.time.monotonic", lambda: now[0])
    index = IndexActor("silent")
    for replica in ("a", "b"):
        stored = BlockStored([f"{replica}-page"], None, [1, 2, 3, 4], PAGE, medium="GPU")
        index.reset(replica, EventBatch("e", 1, KVEventBatch(0.0, [stored])))
        assert index.position(replica) == ("e", 1)
    now[0] += SILENT_S / 2
    index.position("a")
    assert index.size() == 2
    now[0] += SILENT_S / 2 + 1  # b silent for longer than SILENT_S, a not
    index.position("a")
    assert index.replicas() == ["a"] and index.size() == 1


def test_a_routers_copy_follows_a_replica_whose_ranks_die_and_re_form(
    ray_local: None, two_replicas: int
) -> None:
    """A cache router keeps its copy of the index (what every decision reads) while one
    replica's rank 0 is killed: the replica is down there at once and re-forms with no
    call to make it; the copy then holds none of the pages it lost and all of the other
    replica's, and the router ranks by that; no call fails and the copy never goes
    stale."""
    port, follower = two_replicas, Follower(PAGE)
    try:  # new conversations go to the emptier replica until the other's pending work shows
        prompts = _spread(
            port, [[(17 * c + 3 * i) % 200 + 1 for i in range(PAGES * PAGE)] for c in range(30)]
        )
        index = _index()
        held, replicas = _holders(index, prompts), sorted(ray.get(index.replicas.remote()))
        for c, prompt in enumerate(prompts):  # the copy agrees with the index, and ranks by it
            wait_until(partial(_shows, follower, held[c], prompt, PAGES), 60, "the copy")
            assert follower.first(replicas, prompt) == held[c]
        lost = max(set(held.values()), key=list(held.values()).count)  # 3 or more
        (kept,) = set(replicas) - {lost}
        first, *others = [c for c in sorted(held) if held[c] == lost]
        rank0 = [n for n in _live_ranks() if f"-{lost}-" in n and n.endswith("rank0")]
        assert len(rank0) == 1, rank0
        ray.kill(ray.get_actor(rank0[0], namespace="hicache"), no_restart=True)
        for c in [first, *others]:  # down at once, then re-formed: its caches empty
            wait_until(partial(_shows, follower, lost, prompts[c], 0), 60, "the copy's reset")
        wait_until(lambda: lost not in follower.down(), 120, "the replica re-formed, uncalled")
        answer = _complete(port, prompts[first] + [5] * PAGE)  # the emptier cache again
        assert answer["usage"]["prompt_tokens_details"]["hicache"]["replica"] == lost
        for c, prompt in enumerate(prompts):
            if held[c] == kept:
                assert follower.device(kept, prompt) == PAGES
                assert follower.first(replicas, prompt) == kept
        assert follower.copy_fresh()
    finally:
        follower.close()


def _spread(port: int, prompts: list[list[int]]) -> list[list[int]]:
    """Send ``prompts`` as first turns, six at once (so they spread over both replicas),
    until both replicas hold some of them in the index; the prompts sent."""
    for attempt in range(0, len(prompts), 6):
        sent = prompts[: attempt + 6]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(partial(_complete, port), sent[attempt:]))
        assert all(_cached(a) == 0 for a in answers)  # nothing cached anywhere yet
        index = _index()  # the router made it for the first call
        wait_until(partial(_all_held, index, sent), 60, "the turns in the index")
        if len(set(_holders(index, sent).values())) == 2:
            return sent
    raise AssertionError("every first turn went to one replica")


def _shows(follower: Follower, replica: str, prompt: list[int], pages: int) -> bool:
    return follower.device(replica, prompt) == pages
