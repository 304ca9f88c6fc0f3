"""The main job (``hicache-ray demo``) and ``hicache-ray bench multiturn``.

The demo serves a multi-turn chat on a TP=2 deployment whose working set exceeds L1 and
L1+L2, then continues the same conversations on a TP=4 deployment launched beside it on
the same L3 (the Ray object store): TP=4 starts with empty pools and finds the history in
L3. The benchmark serves one trace in each mode (``none``, ``l1``, ``l1_l2``, ``l1_l2_l3``),
one deployment per mode, and compares each with the LRU oracle of its capacity. Both
re-run a sample of requests from scratch on one rank and require the same greedy tokens.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator

import ray

from actors.deployment import Deployment
from actors.stores import drop_store
from apps.multiturn.driver import Progress, mode_cache, oracle_hits, replay_rounds, serve_rounds
from apps.multiturn.options import ExperimentOptions
from apps.multiturn.report import Series, figures, table
from apps.report import Figure, figure
from hicache_ray.base.storage_config import Fault, RayStorageOptions, StorageConfig
from hicache_ray.engine.model import preset
from hicache_ray.engine.reference import recompute

__all__ = [
    "DEMO_SHAPES",
    "ExperimentOptions",
    "embedded_ray",
    "run_demo",
    "run_multiturn_bench",
    "shared_storage",
]


@contextlib.contextmanager
def embedded_ray(num_cpus: int) -> Iterator[None]:
    """The connected Ray, or a local one started (loopback only) and stopped here."""
    if ray.is_initialized():
        yield
        return
    for name, value in (
        ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
        ("RAY_USAGE_STATS_ENABLED", "0"),
        ("RAY_AUTH_MODE", "disabled"),
    ):
        os.environ.setdefault(name, value)
    ray.init(
        address="local",
        num_cpus=max(num_cpus, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def shared_storage(
    model_id: str,
    options: RayStorageOptions,
    *,
    faults: tuple[Fault, ...] = (),
    fault_seed: int = 0,
) -> StorageConfig:
    """A ``ray`` L3 that deployments of TP 1, 2 and 4 share (unified keys, one KV head per
    object for 4-head models), with optional fault-injection rules."""
    return StorageConfig(
        backend="ray",
        model_id=model_id,
        share_tp=(1, 2, 4),
        ray=options,
        faults=faults,
        fault_seed=fault_seed,
    )


def _capacities(deployment: Deployment) -> tuple[int, int]:
    ctl = deployment.stats().ranks[0].controller
    assert ctl is not None
    return ctl.device_pages_total, ctl.host_pages_total


def _exactness(
    series: list[Series], opts: ExperimentOptions, log: Callable[[str], None], extra_wrong: int = 0
) -> Figure:
    """Re-run ``opts.check`` sampled requests from scratch; count wrong greedy tokens (plus
    ``extra_wrong`` found another way)."""
    pool = [
        (p, r)
        for s in series
        for summary in s.rounds
        for p, r in zip(summary.prompts, summary.results, strict=True)
    ]
    sample = random.Random(opts.seed).sample(pool, min(opts.check, len(pool)))
    wrong = 0
    model = preset(opts.model)
    for prompt, result in sample:
        if recompute(model, prompt, len(result.output_tokens)) != result.output_tokens:
            wrong += 1
            log(f"exactness: {result.rid} differs from its recompute")
    log(f"exactness: {len(sample) - wrong} of {len(sample)} sampled requests equal recompute")
    return figure(
        "multiturn.exactness.wrong_outputs",
        wrong + extra_wrong,
        "requests",
        target=0,
        better="lower",
    )


def _speedups(series: list[Series], baselines: list[Series], found: list[Figure]) -> list[Figure]:
    """``demo.<shape>.ttft_p50_speedup``: each shape's TTFT p50 without the cache over with."""
    out = []
    for cached, base in zip(series, baselines, strict=True):
        with_cache = cached.rounds and figure_value(found, f"multiturn.{cached.name}.ttft_p50_ms")
        without = figure_value(found, f"multiturn.{base.name}.ttft_p50_ms")
        speedup = without / with_cache if with_cache else 0.0
        target = {"tp2": 2.5, "tp4": 2.0}.get(cached.name)
        out.append(figure(f"demo.{cached.name}.ttft_p50_speedup", speedup, "x", target=target))
    return out


DEMO_SHAPES = (("tp2", 2), ("tp4", 4))  # the demo's deployments: name, TP size (PP 1)


def run_demo(
    opts: ExperimentOptions, log: Callable[[str], None]
) -> tuple[list[Series], list[Figure]]:
    """TP=2 serves ``opts.rounds`` rounds, TP=4 (launched beside it, same L3) continues
    ``opts.continue_rounds`` more; then each shape serves the same requests again with no
    cache at all (its baseline), whose answers must equal the cached ones."""
    total = opts.rounds + opts.continue_rounds
    trace = opts.trace(total)
    cache = opts.cache()
    series: list[Series] = []
    with embedded_ray(2 + 4):
        tp2 = Deployment.launch(opts.deployment("demo-tp2", cache, tp_size=2, pp_size=1))
        tp4 = Deployment.launch(opts.deployment("demo-tp4", cache, tp_size=4, pp_size=1))
        try:
            log(f"launched TP=2 and TP=4 deployments of the {opts.model!r} model")
            for name, deployment, rounds in (
                ("tp2", tp2, range(opts.rounds)),
                ("tp4", tp4, range(opts.rounds, total)),
            ):
                summaries = serve_rounds(
                    deployment,
                    trace,
                    rounds,
                    label=name,
                    concurrency=opts.concurrency,
                    progress=Progress(name, len(rounds), first=rounds.start),
                )
                deployment.wait_idle(timeout_s=300)  # its pages are in L3 before the next
                series.append(Series(name, summaries, oracle_target=0.95))
            served = [r for s in series for r in s.rounds]
            best = oracle_hits(served, None, opts.page_size, opts.concurrency, opts.rate)
            for summary, hits in zip(served, best, strict=True):
                summary.oracle_hit_tokens = hits  # L3 is unbounded: the infinite cache
        finally:
            tp2.shutdown()
            tp4.shutdown()
            if opts.storage == "ray" and not opts.keep_store:
                drop_store(cache.storage.ray.name)
        baselines = [
            _baseline(opts, cached, tp, log)
            for cached, (_, tp) in zip(series, DEMO_SHAPES, strict=True)
        ]
    differ = sum(
        a.output_tokens != b.output_tokens
        for cached, base in zip(series, baselines, strict=True)
        for a, b in zip(cached.results, base.results, strict=True)
    )
    if differ:
        log(f"exactness: {differ} answers with the cache differ from the no-cache baseline's")
    everything = [x for pair in zip(series, baselines, strict=True) for x in pair]
    found = figures(everything, sum(best))
    found += _speedups(series, baselines, found)
    found.append(_exactness(series, opts, log, extra_wrong=differ))
    log(table(everything))
    return everything, found


def figure_value(found: list[Figure], name: str) -> float:
    return next(f.value for f in found if f.name == name)


def _baseline(
    opts: ExperimentOptions, cached: Series, tp: int, log: Callable[[str], None]
) -> Series:
    """The requests ``cached`` served, again on a deployment of the same shape with no
    cache (every prompt recomputed)."""
    cache, reuse = mode_cache("none", opts.cache())
    name = f"{cached.name}-nocache"
    deployment = Deployment.launch(
        opts.deployment(f"demo-{name}", cache, tp_size=tp, pp_size=1, reuse_prefix=reuse)
    )
    try:
        log(f"{name}: the same requests on TP={tp} with no cache")
        first = cached.rounds[0].round
        summaries = replay_rounds(
            deployment,
            cached.rounds,
            label=name,
            concurrency=opts.concurrency,
            rate=opts.rate,
            seed=opts.seed,
            progress=Progress(name, len(cached.rounds), first=first),
        )
    finally:
        deployment.shutdown()
    return Series(name, summaries)


def run_multiturn_bench(
    opts: ExperimentOptions, log: Callable[[str], None]
) -> tuple[list[Series], list[Figure]]:
    """The same trace in each mode; measured hits beside the LRU oracle of each mode."""
    series = []
    answers: list[list[list[int]]] | None = None
    with embedded_ray(opts.tp_size * opts.pp_size):
        for mode in opts.modes:
            cache, reuse = mode_cache(mode, opts.cache())
            deployment = Deployment.launch(
                opts.deployment(f"mt-{mode.replace('_', '-')}", cache, reuse_prefix=reuse)
            )
            try:
                summaries = serve_rounds(
                    deployment,
                    opts.trace(opts.rounds),
                    range(opts.rounds),
                    label=mode,
                    concurrency=opts.concurrency,
                    progress=Progress(mode, opts.rounds),
                )
                device_pages, host_pages = _capacities(deployment)
            finally:
                deployment.shutdown()
                if mode == "l1_l2_l3" and opts.storage == "ray" and not opts.keep_store:
                    drop_store(cache.storage.ray.name)
            # wait_complete makes L3 hits deterministic: only then is its ratio a target
            l3_target = 0.95 if opts.prefetch_policy == "wait_complete" else None
            s = Series(
                mode, summaries, oracle_target={"l1_l2": 0.95, "l1_l2_l3": l3_target}.get(mode)
            )
            if mode != "none":
                # write_through keeps L2 a superset of L1, so L1+L2 hold what the host
                # pool holds (a few more pages when L2 dropped copies of pages still on
                # the device: the ratio can exceed 1). l1_l2_l3: L3 is unbounded.
                capacity = {"l1": device_pages, "l1_l2": host_pages}.get(mode)
                hits = oracle_hits(summaries, capacity, opts.page_size, opts.concurrency, opts.rate)
                for summary, h in zip(summaries, hits, strict=True):
                    summary.oracle_hit_tokens = h
            got = [[r.output_tokens for r in x.results] for x in summaries]
            if answers is not None and got != answers:
                log(f"WARNING: mode {mode} produced other answers than the first mode")
            answers = answers or got
            series.append(s)
    if not series:
        raise ValueError("no modes to run")
    infinite = oracle_hits(series[0].rounds, None, opts.page_size, opts.concurrency, opts.rate)
    found = figures(series, sum(infinite))
    found.append(_exactness(series, opts, log))
    log(table(series))
    return series, found
