"""``hicache-ray bench route``: N replicas behind each router, the same conversations.

For each replica count and router, a fresh ``hicache-ray serve --replicas N --router R``
app on 127.0.0.1 (TP=1 replicas, no L3: the hits counted are L1 + L2, the tiers a router
can win; an L3 would serve every replica alike) gets the same multi-turn conversations,
closed loop: ``clients`` clients, each taking its share of the conversations turn by turn
through ``/v1/completions`` (streamed; the presets' text is token ids, so each answer
comes back exactly and the next turn's prompt is the history plus a new user part). Every
conversation starts with its own ``system_len`` tokens, so the working set exceeds one
replica's L1 + L2 but not the cluster's. Per router: prompt tokens served from cache
(``usage.prompt_tokens_details.cached_tokens``, and by tier from its ``hicache``
extension), TTFT p50/p99, requests/s, failures; and the cache router over the others at the
first replica count.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from apps.bench.options import RouteOptions
from apps.bench.serve_http_bench import free_port, openai_client
from apps.bench.workload import random_tokens
from apps.experiments import embedded_ray
from apps.report import Figure, figure, percentile

__all__ = ["run_route_bench"]

_SERVED = "bench"
_TIERS = ("l1", "l2", "l3")  # usage.prompt_tokens_details.hicache


@dataclass
class _Run:
    """What the clients saw behind one router."""

    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tiers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_TIERS, 0))
    failed: int = 0
    wall_s: float = 0.0


@contextmanager
def _server(opts: RouteOptions, replicas: int, router: str) -> Iterator[str]:
    """``replicas`` engine replicas behind ``router`` on 127.0.0.1; yields the base URL."""
    from ray import serve

    from actors.openai_app import build_app

    args = {
        "model": opts.model,
        "storage": "none",
        "device_tokens": str(opts.device_tokens),
        "page_size": str(opts.page_size),
        "replicas": str(replicas),
        "router": router,
        "served_name": _SERVED,
    }
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(args), name=f"route-{os.getpid()}", route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]


async def _turn(client: Any, prompt: list[int], max_new: int, run: _Run) -> list[int]:
    """One streamed turn; its answer's token ids (empty when it failed)."""
    text, start, ttft = "", time.perf_counter(), None
    try:
        stream = await client.completions.create(
            model=_SERVED,
            prompt=" ".join(map(str, prompt)),  # text, which Ray's prefix router reads
            max_tokens=max_new,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            piece = "".join(c.text for c in chunk.choices)
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            text += piece
            if chunk.usage is not None:
                run.prompt_tokens += chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                run.cached_tokens += (details.cached_tokens or 0) if details else 0
                tiers = (details.model_extra or {}).get("hicache", {}) if details else {}
                for tier in _TIERS:
                    run.tiers[tier] += int(tiers.get(tier, 0))
    except Exception:
        run.failed += 1
        return []
    run.ttft_s.append(ttft if ttft is not None else time.perf_counter() - start)
    return [int(t) for t in text.split()]


async def _clients(url: str, opts: RouteOptions, vocab: int) -> _Run:
    run = _Run()
    history = [random_tokens(vocab, opts.system_len, 1000 + c) for c in range(opts.conversations)]
    async with openai_client(url) as client:

        async def client_loop(k: int) -> None:
            for round_ in range(opts.rounds):
                for c in range(k, opts.conversations, opts.clients):
                    user = random_tokens(vocab, opts.user_len, 10_000 * (round_ + 1) + c)
                    prompt = history[c] + user
                    history[c] = prompt + await _turn(client, prompt, opts.answer_len, run)

        started = time.perf_counter()
        await asyncio.gather(*(client_loop(k) for k in range(opts.clients)))
        run.wall_s = time.perf_counter() - started
    return run


def _figures(prefix: str, run: _Run) -> list[Figure]:
    share = run.cached_tokens / run.prompt_tokens if run.prompt_tokens else 0.0
    rate = len(run.ttft_s) / run.wall_s if run.wall_s else 0.0
    return [
        figure(f"{prefix}.hit_tokens", float(run.cached_tokens), "tokens"),
        *(figure(f"{prefix}.hit_tokens.{t}", float(n), "tokens") for t, n in run.tiers.items()),
        figure(f"{prefix}.hit_share", share, "x"),
        figure(f"{prefix}.ttft_p50_ms", percentile(run.ttft_s, 50) * 1e3, "ms", better="lower"),
        figure(f"{prefix}.ttft_p99_ms", percentile(run.ttft_s, 99) * 1e3, "ms", better="lower"),
        figure(f"{prefix}.requests_per_s", rate, "1/s"),
        figure(f"{prefix}.failed", float(run.failed), "requests", better="lower"),
    ]


def run_route_bench(opts: RouteOptions, log: Callable[[str], None] = print) -> list[Figure]:
    """Every replica count with every router; the comparisons at the first count."""
    from hicache_ray.model import preset

    vocab = preset(opts.model).vocab_size
    out: list[Figure] = []
    runs: dict[tuple[int, str], _Run] = {}
    for n in opts.replicas:
        for router in opts.routers:
            with embedded_ray(n + 1), _server(opts, n, router) as url:
                run = asyncio.run(_clients(url, opts, vocab))
            runs[n, router] = run
            log(
                f"route: {n} replicas, {router}: {run.cached_tokens} of {run.prompt_tokens} "
                f"prompt tokens cached, TTFT p50 {percentile(run.ttft_s, 50) * 1e3:.0f} ms, "
                f"{len(run.ttft_s) / max(run.wall_s, 1e-9):.2f} requests/s, {run.failed} failed"
            )
            out += _figures(f"route.r{n}.{router}", run)
    return out + _comparisons(runs, opts.replicas[0])


def _comparisons(runs: dict[tuple[int, str], _Run], n: int) -> list[Figure]:
    failed = float(sum(r.failed for r in runs.values()))
    out = [figure("route.failed_requests", failed, "requests", target=0, better="lower")]
    cache = runs.get((n, "cache"))
    if cache is None:
        return out
    for other, target in (("pow2", 1.5), ("prefix", 1.1)):
        base = runs.get((n, other))
        if base is not None:
            ratio = cache.cached_tokens / max(1, base.cached_tokens)
            out.append(figure(f"route.cache_vs_{other}.hit_tokens", ratio, "x", target=target))
    pow2 = runs.get((n, "pow2"))
    if pow2 is not None and cache.ttft_s and pow2.ttft_s:
        ratio = percentile(cache.ttft_s, 50) / percentile(pow2.ttft_s, 50)
        out.append(figure("route.cache_vs_pow2.ttft_p50", ratio, "x", target=0.7, better="lower"))
    return out
