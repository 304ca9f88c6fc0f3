"""Every example runs: the core in an engine loop, heterogeneous TP, the Serve app."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest

ray = pytest.importorskip("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_embed_core_reuses_history_exactly() -> None:
    from examples import embed_core

    turns = embed_core.main()
    assert [exact for _, _, exact in turns] == [True, True, True]
    assert turns[0][1] == 0 and turns[1][1] > 0 and turns[2][1] > turns[1][1]


def test_hetero_tp_continues_on_tp4_from_l3(ray_local: None) -> None:
    from examples import hetero_tp

    totals = hetero_tp.main(["--clients", "2"])
    assert totals["requests"] == 2 and totals["wrong"] == 0
    assert totals["tp4_l3_hit_tokens"] >= 2 * 96


def _post(port: int, body: dict[str, Any] | bytes) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_serve_app_answers_http_with_cache_statistics(ray_local: None) -> None:
    from ray import serve

    from examples import serve_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(serve_app.app, name="hicache", route_prefix="/")
        tokens = list(range(1, 60))
        status, first = _post(port, {"tokens": tokens, "max_new_tokens": 4})
        assert status == 200 and len(first["output_tokens"]) == 4
        status, again = _post(
            port, {"tokens": tokens + first["output_tokens"] + [7], "max_new_tokens": 4}
        )
        assert status == 200 and again["device_hit_tokens"] >= 48
        status, bad = _post(port, {"tokens": [10**6]})
        assert status == 400 and "vocabulary" in bad["error"]
        for body in BAD_BODIES:
            status, bad = _post(port, body)
            assert status == 400 and bad["error"].startswith("bad request body"), (body, bad)
        status, bad = _post(port, b'{"tokens": [' + b"1, " * 400_000 + b"1]}")
        assert status == 413 and "over" in bad["error"]
        status, mine = _post(port, {"tokens": tokens, "max_new_tokens": 1, "rid": "client-7"})
        assert status == 200 and mine["rid"] == "client-7"
        # no client input re-formed the deployment or wiped its cache
        app = serve.get_app_handle("hicache")
        stats = app.stats.remote().result(timeout_s=60)
        assert stats["generation"] == 0 and not stats["reforms"]
        status, last = _post(port, {"tokens": [*tokens, 9], "max_new_tokens": 1})
        assert status == 200 and last["device_hit_tokens"] >= 48
    finally:
        serve.shutdown()
    from actors.stores import store_exists

    assert not store_exists("serve")  # the app dropped its store when it shut down


# Bodies that must be refused with 400 (never 500, never coerced into a request).
BAD_BODIES: list[dict[str, Any] | bytes] = [
    {"nothing": 1},
    {"tokens": [1, 2, 3], "rid": 123},
    {"tokens": [1, 2, 3], "rid": ["x"]},
    {"tokens": [1, 2, 3], "rid": {"a": 1}},
    b'{"tokens": [1e400]}',
    b'{"tokens": [1, 2], "max_new_tokens": 1e400}',
    {"tokens": "1234"},
    {"tokens": [1.9, 2.0]},
    {"tokens": [True, 2]},
    {"tokens": {"1": 2}},
    {"tokens": [1, 2], "max_new_tokens": 2.7},
    {"tokens": [1, 2], "max_new_tokens": "4"},
    {"tokens": [1, 2], "extra": 1},
    b'{"tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b"not json",
    b"[1, 2, 3]",
]
