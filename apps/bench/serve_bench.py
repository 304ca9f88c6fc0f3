"""``hicache-ray bench serve``: clients chatting with a deployment under load.

Each mode (``none``: no prefix reuse; ``l1_l2``: no L3; ``l1_l2_l3``: the Ray object store)
gets its own deployment and the same multi-turn conversations. Closed loop (``rate`` 0):
every client sends its next turn as soon as its last answer is in. Open loop: turns are
released at ``rate`` per second (exponential gaps), each still after its client's previous
answer. Requests stream, so the time to the first token and the gaps between tokens are
measured where a client sees them. Two more measurements: decode tokens/s with 16 requests
running at once beside the same 16 one at a time (the batching speedup), and an overload
run with 4x more concurrent clients than the device pool holds (every request must be
answered: the admission queue holds the rest).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from actors.deployment import Deployment
from actors.stores import drop_store
from apps.bench.serve_http_bench import run_http_modes
from apps.bench.serve_options import ServeOptions, Turn, mode_figures
from apps.multiturn.driver import mode_cache
from apps.report import Figure, figure
from hicache_ray.engine.request import GenerateRequest

__all__ = ["run_serve_bench"]


async def _stream(dep: Deployment, request: GenerateRequest) -> tuple[Turn, list[int]]:
    turn, out = Turn(), list[int]()
    start = last = time.perf_counter()
    try:
        async for chunk in dep.stream(request):
            now = time.perf_counter()
            if chunk.tokens:
                if not out:
                    turn.ttft_s = now - start
                else:
                    turn.itl_s.append((now - last) / len(chunk.tokens))
                last = now
                out += chunk.tokens
            if chunk.result is not None:
                turn.failed = chunk.result.error is not None
                turn.queue_s = chunk.result.queue_s
                turn.split = chunk.result.ttft_split
    except Exception:
        turn.failed = True
    turn.tokens = len(out)
    return turn, out


async def _clients(dep: Deployment, opts: ServeOptions, tag: str) -> tuple[list[Turn], float]:
    """Every client's conversation; returns the turns and the wall time."""
    exp = opts.experiment
    trace = exp.trace(exp.rounds)
    turns: list[Turn] = []
    rnd = random.Random(exp.seed)
    gate = asyncio.Semaphore(0) if opts.rate > 0 else None

    async def release() -> None:  # open loop: one turn released per exponential gap
        assert gate is not None
        for _ in range(exp.clients * exp.rounds):
            gate.release()
            await asyncio.sleep(rnd.expovariate(opts.rate))

    async def client(c: int) -> None:
        for round_ in range(exp.rounds):
            user, answer_len = trace.turns[round_][c]
            prompt = trace.history[c] + user
            if gate is not None:
                await gate.acquire()
            turn, out = await _stream(
                dep, GenerateRequest(f"{tag}-c{c}-r{round_}", prompt, answer_len)
            )
            turns.append(turn)
            trace.history[c] = prompt + out

    if opts.warm_up:
        await dep.generate_async(GenerateRequest(f"{tag}-warm-up", list(trace.history[0]), 1))
    started = time.perf_counter()
    tasks = [client(c) for c in range(exp.clients)]
    if gate is not None:
        tasks.append(release())
    await asyncio.gather(*tasks)
    return turns, time.perf_counter() - started


async def _decode_rate(dep: Deployment, n: int, tokens: int, batched: bool) -> float:
    """Generated tokens per second of ``n`` requests with short prompts, all at once or one
    after the other."""
    requests = [
        GenerateRequest(f"decode-{batched}-{i}", [1 + i, 2, 3, 4], tokens) for i in range(n)
    ]
    started = time.perf_counter()
    if batched:
        results = await asyncio.gather(*(dep.generate_async(r) for r in requests))
    else:
        results = [await dep.generate_async(r) for r in requests]
    wall = time.perf_counter() - started
    return sum(len(r.output_tokens) for r in results) / wall


def _run_mode(
    mode: str, opts: ServeOptions, log: Callable[[str], None]
) -> tuple[list[Turn], float]:
    exp = opts.experiment
    cache, reuse = mode_cache(mode, exp.cache())
    name = f"serve-{mode.replace('_', '-')}" + ("" if opts.warm_up else "-cold")
    dep = Deployment.launch(exp.deployment(name, cache, reuse_prefix=reuse))
    try:
        turns, wall = asyncio.run(_clients(dep, opts, mode))
    finally:
        dep.shutdown()
        if mode == "l1_l2_l3" and exp.storage == "ray" and not exp.keep_store:
            drop_store(cache.storage.ray.name)
    log(f"serve {mode}{'' if opts.warm_up else ' (cold)'}: {len(turns)} turns in {wall:.1f} s")
    return turns, wall


def run_serve_bench(opts: ServeOptions, log: Callable[[str], None] = print) -> list[Figure]:
    """Every mode under load, then the batching and overload measurements."""
    from apps.experiments import embedded_ray

    exp = opts.experiment
    found: list[Figure] = []
    rates: dict[str, float] = {}
    with embedded_ray(exp.tp_size * exp.pp_size):
        for mode in opts.modes:
            turns, wall = _run_mode(mode, opts, log)
            found += mode_figures(mode, turns, wall)
            rates[mode] = sum(not t.failed for t in turns) / wall
        api: dict[str, float] = {}
        if "none" in rates and "l1_l2_l3" in rates:
            api["cache_speedup"] = rates["l1_l2_l3"] / rates["none"]
            found.append(figure("serve.cache_speedup", api["cache_speedup"], "x", target=3.0))
            if opts.warm_up:
                found.append(_cold_speedup(opts, log))
        batching = _batching(opts, log)
        api["batching_speedup"] = batching[-1].value
        found += batching
        found += _overload(opts, log)
        if opts.http:
            found += run_http_modes(opts, api, log)
    return found


def _cold_speedup(opts: ServeOptions, log: Callable[[str], None]) -> Figure:
    """``serve.cache_speedup`` without the untimed warm-up: fresh deployments, and every
    conversation's first turn computes the shared system prompt in the timed run."""
    exp = opts.experiment  # a store of its own: the warm run's pages may be kept
    cold = replace(opts, warm_up=False, experiment=replace(exp, store=f"{exp.store}-cold"))
    rates = {}
    for mode in ("none", "l1_l2_l3"):
        turns, wall = _run_mode(mode, cold, log)
        rates[mode] = sum(not t.failed for t in turns) / wall
    return figure("serve.cache_speedup.cold", rates["l1_l2_l3"] / rates["none"], "x", target=2.5)


def _batching(opts: ServeOptions, log: Callable[[str], None]) -> list[Figure]:
    exp = opts.experiment
    cache, _ = mode_cache("l1_l2", exp.cache())
    dep = Deployment.launch(exp.deployment("serve-batching", cache))
    try:
        n, tokens = opts.batch_running, opts.decode_tokens
        asyncio.run(_decode_rate(dep, 2, 4, batched=True))  # warm up
        alone = asyncio.run(_decode_rate(dep, n, tokens, batched=False))
        batched = asyncio.run(_decode_rate(dep, n, tokens, batched=True))
    finally:
        dep.shutdown()
    log(f"decode: {batched:.0f} tok/s with {n} running, {alone:.0f} tok/s one at a time")
    return [
        figure(f"serve.decode_tokens_per_s.running{n}", batched, "tok/s"),
        figure("serve.decode_tokens_per_s.one_at_a_time", alone, "tok/s"),
        figure("serve.batching_speedup", batched / alone, "x", target=3.0),
    ]


def _overload(opts: ServeOptions, log: Callable[[str], None]) -> list[Figure]:
    """4x more concurrent clients than the device pool holds: every one answered."""
    exp = opts.experiment
    trace = exp.trace(1)
    longest = max(len(trace.history[c] + u) + a for c, (u, a) in enumerate(trace.turns[0]))
    fits = 2  # the pool holds two of these requests at once
    pages = -(-longest // exp.page_size) * fits
    small = replace(
        exp,
        device_tokens=pages * exp.page_size,
        clients=fits * opts.overload_factor,
        rounds=2,
        host_ratio=max(exp.host_ratio, 2.0),
    )
    cache, _ = mode_cache("l1_l2", small.cache())
    dep = Deployment.launch(small.deployment("serve-overload", cache))
    try:
        turns, wall = asyncio.run(
            _clients(dep, replace(opts, experiment=small, rate=0.0), "overload")
        )
    finally:
        dep.shutdown()
    failed = sum(t.failed for t in turns)
    wait_ms = statistics.median([t.queue_s for t in turns]) * 1e3
    log(
        f"overload: {len(turns)} turns of {small.clients} clients over a pool holding {fits}: "
        f"{failed} failed, queue wait p50 {wait_ms:.0f} ms"
    )
    return [
        figure("serve.overload.failed_requests", failed, "requests", target=0, better="lower"),
        figure("serve.overload.requests_per_s", (len(turns) - failed) / wall, "req/s"),
    ]
