"""``hicache-ray bench route``: N replicas behind each router, the same conversations.

For each replica count, scenario and router, a fresh ``hicache-ray serve --replicas N
--router R`` app on 127.0.0.1 (TP=1 replicas; a shared ray L3 in ``tiers``, ``hot``,
``burst``, ``reform`` and ``trace``, none in the others) gets the same multi-turn
conversations, closed loop, each round's turns in the same seeded random order
(:mod:`apps.bench.route_clients`). Every conversation starts with its own ``system_len``
tokens, so the working set exceeds one replica's L1 + L2 but not the cluster's. The
scenarios, each at every replica count:

* ``base``: the conversations through one ingress.
* ``ingresses``: through two ingress replicas, each with its own router instance (as two
  gateways): a router that learns from what it routed sees half of each conversation.
* ``restart``: one engine replica is killed after round ``rounds // 2`` and replaced by
  Serve with empty caches.
* ``pressure``: ``pressure_conversations`` conversations, a working set close to the
  cluster's L1 + L2: evictions everywhere.
* ``tiers``: the base conversations with ``hot_clients`` clients over a ray L3: the
  working set (6,432 tokens by default) exceeds the cluster's L1 (4,096) and fits its
  L1 + L2 (8,192), so many hits come from L2, and a router has to weigh them against load.
* ``hot``: every conversation starts with one ``hot_shared_len``-token system prompt
  (computed once, alone, before the rest arrive), ``hot_clients`` clients keep the
  replicas near capacity, and the replicas share a ray L3: a router that keeps every turn
  where the shared prompt is cached queues them all on one replica.
* ``burst``: the conversations come in groups of ``burst_siblings``, each group over its
  own new ``hot_shared_len``-token prompt, and a group's first turns arrive at once (agent
  forks, a new system prompt); a ray L3.
* ``reform``: one engine replica's rank 0 is killed after round ``rounds // 2``; the
  replica keeps its id and re-forms its deployment with empty caches; a ray L3.
* ``trace``: the shipped conversation trace's first ``trace_requests`` requests
  (:mod:`apps.bench.route_trace`), ``hot_clients`` in flight in trace order; a ray L3.

Per run: prompt tokens served from cache (``usage.prompt_tokens_details.cached_tokens``,
and by tier from its ``hicache`` extension), TTFT p50/p90/p99, requests/s, failures, the
share of turns sent to a replica holding less of their prefix than the best one did, the
busiest replica's share of the turns (the ``hicache`` extension names the replica), and
behind Ray's prefix router its tree's size at the end. The comparisons
(``route.cache_vs_*``) add up every scenario at one replica count.

``engine="vllm"``: the same through vLLM replicas on Ray Serve LLM (``route.vllm.*``,
:mod:`apps.bench.route_vllm`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from apps.bench.options import RouteOptions
from apps.bench.route_clients import (
    ENGINE_DEPLOYMENTS,
    SERVED,
    RouteRun,
    Scenario,
    converse,
    reform_one_engine,
    restart_one_engine,
)
from apps.bench.route_cost_bench import router_cost_figures
from apps.bench.route_trace import prefix_tree_chars, replay_trace, trace_l1
from apps.bench.route_vllm import INDEX_APP
from apps.bench.serve_http_bench import free_port
from apps.experiments import embedded_ray
from apps.report import Figure, figure, percentile

__all__ = ["run_route_bench", "scenarios"]

_APP = f"route-{os.getpid()}"  # the Serve application


def scenarios(opts: RouteOptions) -> dict[str, Scenario]:
    """The scenarios of ``opts`` by name (see the module docstring)."""
    every = {
        "base": Scenario("base"),
        "ingresses": Scenario("ingresses", ingresses=2),
        "restart": Scenario("restart", restart_after=max(1, opts.rounds // 2)),
        "pressure": Scenario("pressure", conversations=opts.pressure_conversations),
        "tiers": Scenario("tiers", clients=opts.hot_clients, storage="ray"),
        "hot": Scenario(
            "hot", clients=opts.hot_clients, shared_len=opts.hot_shared_len, storage="ray"
        ),
        "burst": Scenario(
            "burst", shared_len=opts.hot_shared_len, burst=opts.burst_siblings, storage="ray"
        ),
        "reform": Scenario("reform", reform_after=max(1, opts.rounds // 2), storage="ray"),
    }
    if "trace" in opts.scenarios:
        every["trace"] = Scenario(
            "trace",
            clients=opts.hot_clients,
            storage="ray",
            trace=opts.trace_requests,
            device_tokens=trace_l1(opts),
        )
    return {name: every[name] for name in opts.scenarios}


@contextmanager
def _server(opts: RouteOptions, replicas: int, router: str, scenario: Scenario) -> Iterator[str]:
    """``replicas`` engine replicas behind ``router`` on 127.0.0.1; yields the base URL."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(_app(opts, replicas, router, scenario), name=_APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]


def _app(opts: RouteOptions, replicas: int, router: str, scenario: Scenario) -> Any:
    """The Serve app of ``replicas`` engine replicas behind ``router``."""
    from actors.openai_app import build_app

    if opts.engine == "vllm":
        from apps.bench.route_vllm import vllm_route_app

        return vllm_route_app(opts, replicas, router, scenario)
    args = {
        "model": opts.model,
        "storage": scenario.storage,
        "device_tokens": str(scenario.device_tokens or opts.device_tokens),
        "page_size": str(opts.page_size),
        "replicas": str(replicas),
        "router": router,
        "ingresses": str(scenario.ingresses),
        "served_name": SERVED,
        "route_weights": opts.route_weights,
    }
    return build_app(args)


def _one(opts: RouteOptions, n: int, router: str, scenario: Scenario, vocab: int) -> RouteRun:
    """One fresh app, one scenario's conversations."""
    with embedded_ray(n + scenario.ingresses), _server(opts, n, router, scenario) as url:
        # the index is named after the deployment (vLLM's: after the cluster)
        app = INDEX_APP if opts.engine == "vllm" else f"openai-{os.getpid()}"
        disrupt = (
            partial(restart_one_engine, _APP, n)
            if scenario.restart_after
            else partial(reform_one_engine, app)
        )
        if scenario.trace:
            run = asyncio.run(replay_trace(url, opts, scenario, app, vocab))
        else:
            run = asyncio.run(converse(url, opts, scenario, app, vocab, disrupt))
        if router == "prefix":
            run.tree_chars = prefix_tree_chars(_APP, ENGINE_DEPLOYMENTS[opts.engine == "vllm"])
        return run


def _figures(prefix: str, run: RouteRun) -> list[Figure]:
    share = run.cached_tokens / run.prompt_tokens if run.prompt_tokens else 0.0
    rate = len(run.ttft_s) / run.wall_s if run.wall_s else 0.0
    misrouted = run.misrouted / run.judged if run.judged else 0.0
    busiest = max(run.served_by.values(), default=0) / max(1, sum(run.served_by.values()))
    return [
        figure(f"{prefix}.hit_tokens", float(run.cached_tokens), "tokens"),
        *(figure(f"{prefix}.hit_tokens.{t}", float(n), "tokens") for t, n in run.tiers.items()),
        figure(f"{prefix}.hit_share", share, "x"),
        figure(f"{prefix}.misrouted_share", misrouted, "x", better="lower"),
        figure(f"{prefix}.busiest_share", busiest, "x", better="lower"),
        figure(f"{prefix}.ttft_p50_ms", percentile(run.ttft_s, 50) * 1e3, "ms", better="lower"),
        figure(f"{prefix}.ttft_p90_ms", percentile(run.ttft_s, 90) * 1e3, "ms", better="lower"),
        figure(f"{prefix}.ttft_p99_ms", percentile(run.ttft_s, 99) * 1e3, "ms", better="lower"),
        figure(f"{prefix}.requests_per_s", rate, "1/s"),
        figure(f"{prefix}.failed", float(run.failed), "requests", better="lower"),
        *(
            [figure(f"{prefix}.tree_chars", float(run.tree_chars), "chars", better="lower")]
            if run.tree_chars is not None
            else []
        ),
    ]


def run_route_bench(opts: RouteOptions, log: Callable[[str], None] = print) -> list[Figure]:
    """Every scenario with every router; the comparisons at the first replica count
    (``route.*``; ``route.vllm.*`` with vLLM replicas, :mod:`apps.bench.route_vllm`)."""
    from hicache_ray.engine.model.checkpoint import resolve_model

    vllm = opts.engine == "vllm"
    if vllm:
        from apps.bench.route_vllm import vllm_route_options

        opts = vllm_route_options(opts, log)
    vocab = resolve_model(opts.model).vocab_size
    root = "route.vllm" if vllm else "route"
    out: list[Figure] = []
    every: list[RouteRun] = []
    for n in opts.replicas:
        runs: dict[tuple[str, str], RouteRun] = {}  # (scenario, router) at this count
        for name, scenario in scenarios(opts).items():
            for router in opts.routers:
                run = runs[name, router] = _one(opts, n, router, scenario, vocab)
                every.append(run)
                log(
                    f"route: {name}, {n} replicas, {router}: {run.cached_tokens} of "
                    f"{run.prompt_tokens} prompt tokens cached, TTFT p50 "
                    f"{percentile(run.ttft_s, 50) * 1e3:.0f} ms, misrouted "
                    f"{run.misrouted} of {run.judged}, {run.failed} failed"
                )
                out += _figures(f"{root}.r{n}{'' if name == 'base' else '.' + name}.{router}", run)
                if opts.turn_log:
                    _log_turns(
                        opts.turn_log, {"scenario": name, "router": router, "replicas": n}, run
                    )
        # NOTE: the first count's comparisons carry the targets and keep their old names.
        label = "" if n == opts.replicas[0] else f".r{n}"
        out += _comparisons(runs, list(scenarios(opts)), root + label, not label, vllm)
    if vllm:  # the router's own cost is the same code's: measured with this library's engine
        from apps.bench.route_vllm import wrong_answer_figures

        return out + wrong_answer_figures(opts, every, log)
    cost = router_cost_figures(vocab, opts.page_size, log) if "cache" in opts.routers else []
    return out + cost


def _log_turns(path: str, where: dict[str, Any], run: RouteRun) -> None:
    """Append ``run``'s turns to the JSON Lines file ``path``, each with ``where``."""
    with open(path, "a", encoding="utf-8") as out:
        for turn in run.turns:
            out.write(json.dumps({**where, **turn}) + "\n")


def _pooled(runs: dict[tuple[str, str], RouteRun], names: list[str], router: str) -> RouteRun:
    """One router's runs over ``names`` as one (tokens summed, TTFTs pooled)."""
    pooled = RouteRun()
    for name in names:
        run = runs.get((name, router))
        if run is not None:
            pooled.cached_tokens += run.cached_tokens
            pooled.ttft_s += run.ttft_s
            pooled.failed += run.failed
    return pooled


def _comparisons(
    runs: dict[tuple[str, str], RouteRun], names: list[str], stem: str, first: bool, vllm: bool
) -> list[Figure]:
    """The comparisons of one replica count's runs, named from ``stem`` (``route``,
    ``route.vllm``, then ``.r<N>`` past the first count); targets at the ``first``."""
    failed = float(sum(r.failed for r in runs.values()))
    out = [figure(f"{stem}.failed_requests", failed, "requests", target=0, better="lower")]
    routers = {router for _, router in runs}
    for scope, among in [("", names)] + [(f".{name}", [name]) for name in names]:
        if "cache" not in routers:
            break
        cache = _pooled(runs, among, "cache")
        for other in ("pow2", "prefix"):
            if other not in routers:
                continue
            base = _pooled(runs, among, other)
            ratio = cache.cached_tokens / max(1, base.cached_tokens)
            goal = _goal(vllm, scope, f"{other}.hit_tokens") if first else None
            name = f"{stem}{scope}.cache_vs_{other}.hit_tokens"
            out.append(figure(name, ratio, "x", target=goal))
            for p in (50, 90) if cache.ttft_s and base.ttft_s else ():
                goal = _goal(vllm, scope, f"{other}.ttft_p{p}") if first else None
                ratio = percentile(cache.ttft_s, p) / percentile(base.ttft_s, p)
                name = f"{stem}{scope}.cache_vs_{other}.ttft_p{p}"
                out.append(figure(name, ratio, "x", target=goal, better="lower"))
    return out


def _goal(vllm: bool, scope: str, what: str) -> float | None:
    """The target of the cache router's comparison ``what`` in ``scope`` ("": every
    scenario; ".<scenario>") at the first replica count: this library's engine's (its
    routing issue) or vLLM replicas' (``route.vllm.*``: never below 0.97x the prefix
    router's cached tokens in any scenario, TTFT p90 0.8x its on the trace)."""
    if vllm:
        goals = {"pow2.hit_tokens": 1.5} if not scope else {"prefix.hit_tokens": 0.97}
        if scope == ".trace":
            goals["prefix.ttft_p90"] = 0.8
    else:
        goals = {} if scope else {"pow2.hit_tokens": 1.5, "prefix.hit_tokens": 1.1}
        goals.update({} if scope else {"pow2.ttft_p50": 0.7})
    return goals.get(what)
