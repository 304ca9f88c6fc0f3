"""``hicache-ray bench trace``: a production request trace replayed through the OpenAI app,
graded against the trace's own ideal (docs/cli.md, ``bench trace``).

Each mode (``none``: no prefix reuse; ``l1_l2``: no L3; ``l1_l2_l3``: the ray store) gets a
fresh app (one deployment, or ``replicas`` engine replicas behind ``router``) and the same
requests. Then, unless turned off, the overload run: the same requests open loop at 1.5x
the requests/s the ``none`` run reached, every mode again. A sample of answers is checked
greedy-exact against a no-cache recompute. ``engine="vllm"``: the replicas are vLLM engines
(:mod:`apps.bench.vllm_apps`), checked against a plain vLLM engine.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from apps.bench.serve_http_bench import free_port
from apps.bench.trace_clients import SERVED, Outcome, replay
from apps.bench.trace_data import (
    DEFAULT_TRACE,
    ScaledRequest,
    ideal_hit_tokens,
    load_trace,
    scale,
)
from apps.bench.trace_figures import Ideal, mode_figures, speedups, wrong_outputs
from apps.bench.trace_options import TraceOptions
from apps.report import Figure, figure
from hicache_ray.base.errors import ConfigError

__all__ = ["run_trace_bench", "sized"]

OVERLOAD = 1.5  # the overload run's arrival rate, over the none run's requests/s


def sized(opts: TraceOptions, requests: list[ScaledRequest]) -> tuple[TraceOptions, str]:
    """``opts`` with its L1 sized by the rule (a replica's L1 + L2 holds a quarter of the
    working set; L1 at least two of the longest request), and the rule's line."""
    page = opts.page_size
    pages = {tuple(r.prompt[i : i + page]) for r in requests for i in range(0, len(r.prompt), page)}
    working = (len(pages) + sum(-(-r.max_tokens // page) for r in requests)) * page
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    rule = -(-int(working / 4 / opts.host_ratio) // page) * page
    floor = -(-2 * longest // page) * page
    device = opts.device_tokens or max(rule, floor)
    host = int(device * opts.host_ratio)
    why = "--device-tokens" if opts.device_tokens else "the rule: a quarter"
    if not opts.device_tokens and floor > rule:
        why += ", raised so L1 holds two of the longest request"
    line = (
        f"sizing: working set {working:,} tokens; per replica L1 {device:,} + L2 {host:,} "
        f"tokens (L2 holds every L1 page: {host / working:.2f} of the working set; {why}); "
        "L3 unbounded (holds all of it)"
    )
    return replace(opts, device_tokens=device), line


def _hicache_app(opts: TraceOptions, mode: str, store: str) -> Any:
    from actors.openai_app import serve_app
    from apps.multiturn.driver import mode_cache
    from apps.multiturn.options import ExperimentOptions
    from hicache_ray.base.config import PrefetchConfig

    exp = ExperimentOptions(
        model=opts.model,
        page_size=opts.page_size,
        device_tokens=opts.device_tokens,
        host_ratio=opts.host_ratio,
        tp_size=opts.tp_size,
        pp_size=opts.pp_size,
        store=store,
        prefetch_threshold=PrefetchConfig().threshold_tokens,  # what a server runs with
    )
    cache, reuse = mode_cache(mode, exp.cache())
    config = exp.deployment(f"trace-{mode.replace('_', '-')}", cache, reuse_prefix=reuse)
    return serve_app(config, SERVED, False, opts.replicas, opts.router)


def _vllm_app(opts: TraceOptions, mode: str, store: str) -> Any:
    from apps.bench.vllm_apps import vllm_app

    return vllm_app(
        opts.model,
        SERVED,
        mode,
        replicas=opts.replicas,
        router=opts.router,
        page_size=opts.page_size,
        device_tokens=opts.device_tokens,
        max_len=_max_len(opts),
        store=store,
    )


def _max_len(opts: TraceOptions) -> int:
    """The longest request vLLM admits (the sizing rule fits two of the longest request)."""
    from apps.bench.vllm_apps import vllm_max_len

    return vllm_max_len(opts.model, opts.device_tokens, opts.page_size)


@contextmanager
def _app(opts: TraceOptions, mode: str, store: str) -> Iterator[str]:
    """A fresh app for ``mode`` on 127.0.0.1; yields its base URL."""
    from ray import serve

    from actors.stores import drop_store

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = (_vllm_app if opts.engine == "vllm" else _hicache_app)(opts, mode, store)
        serve.run(app, name="bench-trace", route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        if mode == "l1_l2_l3":
            drop_store(store)


def _run(
    opts: TraceOptions, mode: str, requests: list[ScaledRequest], scale_: float, tag: str
) -> tuple[list[Outcome], float]:
    store = f"trace-{os.getpid()}-{tag}"
    with _app(opts, mode, store) as url:
        label, vllm = f"{tag} {mode}", opts.engine == "vllm"
        return asyncio.run(replay(url, requests, opts.clients, scale_, label, vllm))


def _ideal(opts: TraceOptions, requests: list[ScaledRequest]) -> Ideal:
    capacity = int(opts.device_tokens * opts.host_ratio) // opts.page_size * opts.replicas
    return Ideal(
        infinite=ideal_hit_tokens(requests, opts.page_size),
        lru=ideal_hit_tokens(requests, opts.page_size, capacity),
        lru_pages=capacity,
    )


def _series(
    opts: TraceOptions,
    requests: list[ScaledRequest],
    scale_: float,
    tag: str,
    log: Callable[[str], None],
) -> dict[str, tuple[list[Outcome], float]]:
    runs = {}
    for mode in opts.modes:
        runs[mode] = _run(opts, mode, requests, scale_, tag)
        outcomes, wall = runs[mode]
        hits = sum(o.hit_tokens for o in outcomes)
        failed = sum(o.failed for o in outcomes)
        log(
            f"trace {tag} {mode}: {len(outcomes)} requests in {wall:.1f} s, {hits} hit tokens, "
            f"{failed} failed"
        )
    return runs


def run_trace_bench(opts: TraceOptions, log: Callable[[str], None] = print) -> list[Figure]:
    """Every mode, then the overload run; the figures of ``trace.*``."""
    from apps.experiments import embedded_ray
    from hicache_ray.engine.model.checkpoint import resolve_model

    for flag_, value in (("--time-scale", opts.time_scale), ("--slo-ttft-ms", opts.slo_ttft_ms)):
        if value < 0:
            raise ConfigError(flag_, value, "must be >= 0", "0 picks the default")
    model = resolve_model(opts.model)
    if opts.engine == "vllm":
        from apps.bench.vllm_apps import VLLM_PAGE, check_vllm_model

        opts = replace(opts, page_size=VLLM_PAGE)
        check_vllm_model(opts.model, opts.page_size)
    trace = load_trace(opts.trace or DEFAULT_TRACE, opts.limit)
    requests = scale(trace, opts.block, model.vocab_size, opts.seed)
    opts, rule = sized(opts, requests)
    log(rule)
    ideal = _ideal(opts, requests)
    log(
        f"ideal: {ideal.infinite} hit tokens (infinite cache), {ideal.lru} (LRU of "
        f"{ideal.lru_pages} pages) of {sum(len(r.prompt) for r in requests)} prompt tokens"
    )
    found = [
        figure("trace.ideal.hit_tokens", ideal.infinite, "tokens"),
        figure("trace.lru_oracle.hit_tokens", ideal.lru, "tokens"),
    ]
    ranks = opts.replicas * opts.tp_size * opts.pp_size
    with embedded_ray(ranks + 1):
        runs = _series(opts, requests, opts.time_scale, "base", log)
        slo = opts.slo_ttft_ms or _default_slo(runs, log)
        for mode, (outcomes, wall) in runs.items():
            found += mode_figures(f"trace.{mode}", outcomes, wall, ideal, slo)
        found += speedups("trace", runs)
        found += wrong_outputs(_answers(opts, model), requests, runs, opts.check, log)
        if opts.overload and "none" in runs:
            outcomes, wall = runs["none"]
            rate = OVERLOAD * sum(not o.failed for o in outcomes) / wall
            span = requests[-1].arrival_s - requests[0].arrival_s
            scale_ = rate * span / max(1, len(requests) - 1) if span > 0 else 1e9
            log(f"overload: {rate:.2f} requests/s offered (trace arrivals divided by {scale_:.2f})")
            heavy = _series(opts, requests, scale_, "overload", log)
            for mode, (outcomes, wall) in heavy.items():
                found += mode_figures(f"trace.overload.{mode}", outcomes, wall, ideal, slo)
            found.append(figure("trace.overload.offered_per_s", rate, "req/s"))
    return found


def _answers(opts: TraceOptions, model: Any) -> Callable[[list[ScaledRequest]], list[list[int]]]:
    """What a no-cache recompute answers: the reference model's, or a plain vLLM engine's."""
    if opts.engine == "vllm":
        from apps.bench.vllm_apps import vllm_recompute

        max_len = _max_len(opts)
        return lambda picked: vllm_recompute(
            opts.model, [r.prompt for r in picked], [r.max_tokens for r in picked], max_len
        )
    from hicache_ray.engine.reference import recompute

    return lambda picked: [recompute(model, r.prompt, r.max_tokens) for r in picked]


def _default_slo(runs: dict[str, tuple[list[Outcome], float]], log: Callable[[str], None]) -> float:
    from apps.report import percentile

    base = runs.get("none") or next(iter(runs.values()))
    median = percentile([o.ttft_s * 1e3 for o in base[0] if not o.failed], 50)
    slo = 2 * median
    log(f"TTFT SLO: {slo:.0f} ms (twice the none run's median; --slo-ttft-ms to set)")
    return slo
