"""The OpenAI-compatible Serve app over a real (tiny, random) Qwen3 checkpoint, driven with
the official ``openai`` client on 127.0.0.1: models, a multi-turn chat whose follow-up
reports cached tokens, streaming, completions, every error status, and API keys with a
cache per tenant (the app runs with a keys file and one ``--api-key`` digest)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ensure_local_ray, free_port
from tests.model.helpers import make_checkpoint

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

STORE = "openai-test"
KEYS = {"alice-key-1": "alice", "alice-key-2": "alice", "bob-key-111": "bob quota=1M"}
SOLO = "solo-key-000"  # given as a digest, as ``--api-key`` does: a tenant of its own


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    from ray import serve

    from actors.openai_app import build_app
    from actors.stores import store_exists
    from hicache_ray.serving.tenants import key_digest

    ensure_local_ray()
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("openai") / "qwen3", "qwen3")
    keys = checkpoint.parent / "keys.txt"
    keys.write_text("# key tenant\n" + "".join(f"{k} {t}\n" for k, t in KEYS.items()))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": str(checkpoint),
        "tp": "2",
        "device_tokens": "1024",
        "page_size": "4",
        "max_queued": "1",
        "store": STORE,
        "api_keys": str(keys),
        "api_key_sha256": key_digest(SOLO),
    }
    try:
        serve.run(build_app(args), name="openai", route_prefix="/")
        yield port, checkpoint
    finally:
        serve.shutdown()
    assert not store_exists(STORE)  # the app dropped its L3 store when it shut down


def _client(port: int, key: str = "alice-key-1") -> Any:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


def test_models_and_a_multi_turn_chat_with_cached_tokens(server: tuple[int, Path]) -> None:
    port, _ = server
    client = _client(port)
    assert [m.id for m in client.models.list().data] == ["qwen3"]
    messages = [{"role": "user", "content": "hello world what is the cache"}]
    first = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=12)
    answer = first.choices[0].message
    assert answer.role == "assistant" and first.choices[0].finish_reason in ("length", "stop")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": answer.content},
        {"role": "user", "content": "why is ray fast"},
    ]
    second = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 8 and cached % 4 == 0  # the first turn's prompt pages came from cache
    tiers = (second.usage.prompt_tokens_details.model_extra or {})["hicache"]
    assert sum(tiers.values()) == cached and set(tiers) == {"l1", "l2", "l3"}
    assert second.usage.total_tokens == second.usage.prompt_tokens + second.usage.completion_tokens


def test_streaming_gives_the_same_text(server: tuple[int, Path]) -> None:
    port, _ = server
    client = _client(port)
    messages = [{"role": "user", "content": "what is a kv page"}]
    whole = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=10)
    stream = client.chat.completions.create(
        model="qwen3",
        messages=messages,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, used = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            used = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].message.content
    assert reasons[-1] == whole.choices[0].finish_reason and used is not None
    assert used.completion_tokens == whole.usage.completion_tokens


def test_completions_with_text_token_ids_and_stop(server: tuple[int, Path]) -> None:
    port, _ = server
    client = _client(port)
    text = client.completions.create(model="qwen3", prompt="the cache is", max_tokens=6)
    assert text.object == "text_completion" and text.usage.prompt_tokens == 3
    ids = client.completions.create(model="qwen3", prompt=[9, 10, 11], max_tokens=6)
    assert ids.choices[0].text == text.choices[0].text  # the same tokens
    words = text.choices[0].text.split()
    if words:  # stop at the first generated word: nothing of it or after it comes back
        stopped = client.completions.create(
            model="qwen3", prompt="the cache is", max_tokens=6, stop=[words[0]]
        )
        assert (
            stopped.choices[0].finish_reason == "stop" and words[0] not in stopped.choices[0].text
        )


def _post(
    port: int, path: str, body: bytes | None, key: str | None = "alice-key-1"
) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_every_error_status(server: tuple[int, Path]) -> None:
    port, _ = server
    client = _client(port)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="qwen3", messages=[{"role": "user", "content": "hi"}], temperature="hot"
        )
    assert "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="qwen3", prompt=list(range(5, 25)) * 30, max_tokens=4)
    assert long.value.code == "context_length_exceeded"
    status, body = _post(
        port, "/v1/completions", b'{"model": "qwen3", "prompt": "' + b"a " * (3 << 20) + b'"}'
    )
    assert status == 413 and body["error"]["code"] == "too_large"
    for raw in (
        b"not json",
        b'{"model": "qwen3"}',
        b'{"model": "qwen3", "prompt": [1.5]}',
        b'{"model": "qwen3", "prompt": "x", "max_tokens": "4"}',
        b'{"model": "qwen3", "prompt": "x", "n": 2}',
    ):
        status, body = _post(port, "/v1/completions", raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", raw
    status, _ = _post(port, "/v1/nothing", b"{}")
    assert status == 404

    for raw in (
        b'{"model": "qwen3", "prompt": "x", "max_tokens": 0}',
        b'{"model": "qwen3", "messages": [{"role": "user", "content": "x"}], '
        b'"max_completion_tokens": 0}',
    ):
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        status, body = _post(port, path, raw)
        assert status == 400 and "max_" in body["error"]["param"], raw

    # overloaded: two requests fit the pool at once and one more may wait; the rest are 503
    # with Retry-After, streamed or not (a stream sends nothing before it is admitted)
    def one(i: int) -> tuple[int, str | None]:
        try:
            if i % 2:
                for _ in client.completions.create(
                    model="qwen3", prompt=[5, 6, 7 + i], max_tokens=400, stream=True
                ):
                    pass
            else:
                client.completions.create(model="qwen3", prompt=[5, 6, 7 + i], max_tokens=400)
        except openai.APIStatusError as exc:
            return int(exc.status_code), exc.response.headers.get("retry-after")
        return 200, None

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    statuses = [status for status, _ in answers]
    assert statuses.count(503) >= 3 and statuses.count(200) >= 2, statuses
    assert all(retry == "1" for status, retry in answers if status == 503), answers


def test_a_call_without_a_valid_key_is_refused_before_any_work(server: tuple[int, Path]) -> None:
    port, _ = server
    body = b'{"model": "qwen3", "prompt": "x"}'
    for key in (None, "", "wrong-key-000", "alice-key-1x"):
        for path, raw in (("/v1/completions", body), ("/v1/models", None), ("/v1/x", b"bad")):
            status, answer = _post(port, path, raw, key)
            assert status == 401, (key, path)
            error = answer["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert "alice" not in error["message"]
    for key in (None, "wrong-key-000"):  # a stream too: refused with a status, no events
        with pytest.raises(openai.AuthenticationError):
            for _ in _client(port, key or "-").completions.create(
                model="qwen3", prompt="x", max_tokens=2, stream=True
            ):
                pass
    status, _ = _post(port, "/v1/models", None, SOLO)
    assert status == 200


def test_tenants_never_share_cached_tokens(server: tuple[int, Path]) -> None:
    """One prompt sent by alice twice (two keys, one tenant), then by bob, the solo key,
    and alice under a cache_salt of her own: only alice's second call hits."""
    port, _ = server
    prompt = list(range(200, 240))

    def cached(key: str, **extra: Any) -> int:
        answer = _client(port, key).completions.create(
            model="qwen3", prompt=prompt, max_tokens=1, extra_body=extra or None
        )
        return int(answer.usage.prompt_tokens_details.cached_tokens)

    assert cached("alice-key-1") == 0
    hit = cached("alice-key-2")  # her other key: the same tenant
    assert hit >= 32
    assert cached("bob-key-111") == 0
    assert cached(SOLO) == 0
    assert cached("alice-key-1", cache_salt="mine") == 0
    assert cached("alice-key-1", cache_salt="mine") == hit
    from actors.shards import shard_name
    from hicache_ray.serving.tenants import Tenant, tenant_owner

    shard = ray.get_actor(shard_name(STORE, 0), namespace="hicache")  # bob's quota reached it
    quotas = ray.get(shard.quotas.remote())
    assert set(quotas) == {tenant_owner("", Tenant("bob"))} and 0 < quotas.popitem()[1] <= 10**6
    status, answer = _post(
        port, "/v1/completions", b'{"model": "qwen3", "prompt": "x", "cache_salt": "a\u0000b"}'
    )
    assert status == 400 and answer["error"]["param"] == "cache_salt"


def _rank_actor(rank: int) -> Any:
    """Rank ``rank`` of the newest generation of the app's deployment."""
    pattern = re.compile(r"hicache-openai-\d+-g(\d+)-rank" + str(rank))
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "hicache" and pattern.fullmatch(a["name"])
    ]
    newest = max(names, key=lambda n: int(pattern.fullmatch(n).group(1)))  # type: ignore[union-attr]
    return ray.get_actor(newest, namespace="hicache")


def test_a_rank_killed_mid_stream_loses_no_request(server: tuple[int, Path]) -> None:
    """12 requests decode together (6 streamed, 6 not); rank 1 dies after every stream sent
    some text; every answer equals the same request run alone. The server queues one
    request (``max_queued=1``): clients retry its 503s after ``Retry-After``."""
    port, _ = server
    client = _client(port).with_options(max_retries=20)
    prompts = [[5 + i, 40 + 3 * i, 70 + i, 9] for i in range(12)]
    reference = [
        client.completions.create(model="qwen3", prompt=p, max_tokens=48).choices[0].text
        for p in prompts
    ]
    started = [threading.Event() for _ in prompts]
    paused: list[int] = []  # streams that had sent text and were still open at the kill
    kill_done = threading.Event()

    def run(i: int) -> str:
        if i % 2:
            answer = client.completions.create(model="qwen3", prompt=prompts[i], max_tokens=48)
            return str(answer.choices[0].text)
        pieces = []
        for chunk in client.completions.create(
            model="qwen3", prompt=prompts[i], max_tokens=48, stream=True
        ):
            pieces += [c.text for c in chunk.choices if c.text]
            if pieces and not started[i].is_set():
                paused.append(i)
                started[i].set()
                kill_done.wait(120)
        started[i].set()  # ended (an early stop) without text to pause at
        return "".join(pieces)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(run, i) for i in range(12)]
        try:
            for i in range(0, 12, 2):
                assert started[i].wait(120), f"stream {i} sent nothing"
            ray.kill(_rank_actor(1), no_restart=True)
        finally:
            kill_done.set()
        texts = [f.result(timeout=300) for f in futures]
    assert len(paused) >= 3, paused
    assert texts == reference
