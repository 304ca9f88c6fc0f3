"""``hicache-ray bench serve --http``: the clients of ``bench serve`` through the OpenAI
endpoint, with the official ``openai`` client (async), beside the Python API in the same run.

Each mode (``none`` and ``l1_l2_l3``) gets its own server on 127.0.0.1 (one Serve replica,
the same settings as the Python-API deployment of that mode); every client chats through
``/v1/completions`` with token-id prompts and streamed answers (the presets' text is token
ids, so the answer's ids come back exactly and the next turn's prompt equals the one the
Python-API clients send). The batching measurement sends ``batch_running`` requests at once
and then one at a time. A 503 is retried by the client after its ``Retry-After``, as a real
client would; a request that still fails counts as failed.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from actors.openai_app import serve_app
from apps.bench.serve_options import ServeOptions, Turn, mode_figures
from apps.multiturn.driver import mode_cache
from apps.report import Figure, figure

__all__ = ["HTTP_MODES", "free_port", "openai_client", "run_http_modes"]

HTTP_MODES = ("none", "l1_l2_l3")
_SERVED = "bench"  # the model name the clients ask for
_RETRIES = 20  # per request, after each 503's Retry-After


def openai_client(url: str) -> Any:
    """The official async client on ``url``, retrying a 503 after its Retry-After."""
    import openai

    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=_RETRIES)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _server(config: Any) -> Iterator[str]:
    """One replica serving ``config`` on 127.0.0.1; yields its base URL."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(serve_app(config, _SERVED), name="bench-http", route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.split()]


async def _turn(client: Any, prompt: list[int], max_new: int) -> tuple[Turn, list[int]]:
    turn, text = Turn(), ""
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=_SERVED, prompt=prompt, max_tokens=max_new, stream=True
        )
        async for chunk in stream:
            piece = "".join(c.text for c in chunk.choices)
            if not piece:
                continue
            now = time.perf_counter()
            new = len(_ids(piece))
            if not text:
                turn.ttft_s = now - start
            elif new:
                turn.itl_s.append((now - last) / new)
            last = now
            text += piece
    except Exception:
        turn.failed = True
    out = _ids(text)
    turn.tokens = len(out)
    return turn, out


async def _clients(url: str, opts: ServeOptions) -> tuple[list[Turn], float]:
    """Every client's conversation, closed loop; the turns and the wall time."""
    exp = opts.experiment
    trace = exp.trace(exp.rounds)
    turns: list[Turn] = []
    async with openai_client(url) as client:

        async def conversation(c: int) -> None:
            for round_ in range(exp.rounds):
                user, answer_len = trace.turns[round_][c]
                prompt = trace.history[c] + user
                turn, out = await _turn(client, prompt, answer_len)
                turns.append(turn)
                trace.history[c] = prompt + out

        if opts.warm_up:
            await _turn(client, list(trace.history[0]), 1)
        started = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(exp.clients)))
    return turns, time.perf_counter() - started


async def _decode_rate(url: str, n: int, tokens: int, batched: bool) -> float:
    """Generated tokens per second of ``n`` short requests, all at once or one by one."""
    async with openai_client(url) as client:

        async def one(i: int) -> int:
            answer = await client.completions.create(
                model=_SERVED, prompt=[1 + i, 2, 3, 4], max_tokens=tokens
            )
            return 0 if answer.usage is None else int(answer.usage.completion_tokens)

        started = time.perf_counter()
        if batched:
            made = await asyncio.gather(*(one(i) for i in range(n)))
        else:
            made = [await one(i) for i in range(n)]
        return sum(made) / (time.perf_counter() - started)


def run_http_modes(
    opts: ServeOptions, api: dict[str, float], log: Callable[[str], None]
) -> list[Figure]:
    """Both modes and the batching measurement over HTTP; ``api`` holds the Python-API
    figures of the same run (``cache_speedup``, ``batching_speedup``) to compare with."""
    exp = opts.experiment
    found: list[Figure] = []
    rates: dict[str, float] = {}
    failed = 0
    for mode in HTTP_MODES:
        cache, reuse = mode_cache(mode, exp.cache())
        name = f"serve-http-{mode.replace('_', '-')}"
        with _server(exp.deployment(name, cache, reuse_prefix=reuse)) as url:
            turns, wall = asyncio.run(_clients(url, opts))
            if mode == "l1_l2_l3":
                n, tokens = opts.batch_running, opts.decode_tokens
                asyncio.run(_decode_rate(url, 2, 4, batched=True))  # warm up
                alone = asyncio.run(_decode_rate(url, n, tokens, batched=False))
                batched = asyncio.run(_decode_rate(url, n, tokens, batched=True))
        log(f"serve --http {mode}: {len(turns)} turns in {wall:.1f} s")
        found += mode_figures(f"http.{mode}", turns, wall)
        rates[mode] = sum(not t.failed for t in turns) / wall
        failed += sum(t.failed for t in turns)
    speedup = rates["l1_l2_l3"] / rates["none"]
    batching = batched / alone
    log(f"serve --http: cache speedup {speedup:.2f}x, batching speedup {batching:.2f}x")
    measured = {"cache_speedup": speedup, "batching_speedup": batching}
    return [
        *found,
        figure("serve.http.cache_speedup", speedup, "x", target=2.5),
        figure("serve.http.batching_speedup", batching, "x", target=3.0),
        # within 15 % of the Python API's figure of the same run
        *(
            figure(f"serve.http.{k}.vs_api", v, "x", ceiling=api.get(k), target=0.85)
            for k, v in measured.items()
        ),
        figure("serve.http.failed_requests", failed, "requests", target=0, better="lower"),
    ]
