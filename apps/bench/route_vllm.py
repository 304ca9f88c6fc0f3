"""``bench route --engine vllm``: the same scenarios, routers and clients through vLLM
replicas on Ray Serve LLM (:mod:`apps.bench.vllm_apps`, :mod:`actors.vllm_serve`).

A scenario with a ray L3 runs the replicas with the connector on one ray store and their
own prefix caches; one without runs their prefix caches only (vLLM has no host tier of
its own). The figures are ``route.vllm.*``, named as the engine's own ``route.*``; each
run's first ``check`` answers are checked against a plain vLLM engine (no connector, no
prefix cache): ``route.vllm.wrong_outputs``. ``reform`` kills one rank of this library's
engine replica and lets it re-form in place; a vLLM replica has no such ranks, so it is
skipped (``restart`` kills and replaces a whole replica for both engines).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from apps.bench.options import RouteOptions
from apps.bench.route_clients import SERVED, RouteRun, Scenario
from apps.report import Figure, figure

__all__ = ["INDEX_APP", "vllm_route_app", "vllm_route_options", "wrong_answer_figures"]

INDEX_APP = f"route-vllm-{os.getpid()}"  # the cluster's index (and the connector's store)


def vllm_route_options(opts: RouteOptions, log: Callable[[str], None]) -> RouteOptions:
    """``opts`` for vLLM: a checkpoint, vLLM's CPU block size, no ``reform``."""
    from apps.bench.vllm_apps import VLLM_PAGE, check_vllm_model

    check_vllm_model(opts.model, VLLM_PAGE)
    if "reform" in opts.scenarios:
        log("route: reform skipped with --engine vllm (a vLLM replica has no ranks to re-form)")
    kept = tuple(s for s in opts.scenarios if s != "reform")
    return replace(opts, page_size=VLLM_PAGE, scenarios=kept)


def vllm_route_app(opts: RouteOptions, replicas: int, router: str, scenario: Scenario) -> Any:
    """The Serve app of ``replicas`` vLLM replicas behind ``router`` for ``scenario``."""
    from apps.bench.vllm_apps import vllm_app, vllm_max_len

    device = scenario.device_tokens or opts.device_tokens
    return vllm_app(
        opts.model,
        SERVED,
        "l1_l2_l3" if scenario.storage == "ray" else "l1_l2",
        replicas=replicas,
        router=router,
        page_size=opts.page_size,
        device_tokens=device,
        max_len=vllm_max_len(opts.model, device, opts.page_size),
        store=INDEX_APP,
        index=INDEX_APP,
        ingresses=scenario.ingresses,
        weights=opts.route_weights,
    )


def wrong_answer_figures(
    opts: RouteOptions, runs: list[RouteRun], log: Callable[[str], None]
) -> list[Figure]:
    """``route.vllm.wrong_outputs``: of each run's first ``opts.check`` answers, those a
    plain vLLM engine answers otherwise (greedy, end-of-sequence ignored, as sent)."""
    from apps.bench.vllm_apps import vllm_recompute
    from apps.experiments import embedded_ray

    picked = [pair for run in runs for pair in run.answers[: opts.check] if pair[1]]
    if not picked:
        return []
    longest = max(len(p) + len(a) for p, a in picked)
    with embedded_ray(1):
        want = vllm_recompute(
            opts.model, [p for p, _ in picked], [len(a) for _, a in picked], longest
        )
    wrong = sum(got != expected for (_, got), expected in zip(picked, want, strict=True))
    log(f"route: {wrong} wrong of {len(picked)} answers checked against a plain vLLM engine")
    return [
        figure("route.vllm.wrong_outputs", float(wrong), "answers", target=0, better="lower"),
        figure("route.vllm.checked_outputs", float(len(picked)), "answers"),
    ]
