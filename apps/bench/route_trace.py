"""``bench route``'s ``trace`` scenario and what it reads of Ray's prefix router.

The trace scenario sends the shipped conversation trace's first requests (scaled as
``bench trace`` scales them: one page of token ids per trace block,
:mod:`apps.bench.trace_data`) through the replicas, closed loop in trace order, each
prompt as text (what Ray's prefix router reads). A request is judged as a conversation
turn is (:class:`apps.bench.route_clients.Truth`). The trace's longest prompts exceed
the other scenarios' L1, so a replica's L1 is raised to hold two of the longest request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from apps.bench.options import RouteOptions
from apps.bench.route_clients import RouteRun, Scenario, Truth, send_turn
from apps.bench.serve_http_bench import openai_client
from apps.bench.trace_data import DEFAULT_TRACE, load_trace, scale

__all__ = ["prefix_tree_chars", "replay_trace", "trace_l1"]


async def replay_trace(
    url: str, opts: RouteOptions, scenario: Scenario, app: str, vocab: int
) -> RouteRun:
    """The trace's first ``scenario.trace`` requests, ``scenario.clients`` in flight."""
    requests = scale(load_trace(DEFAULT_TRACE, scenario.trace), opts.page_size, vocab)
    run, truth = RouteRun(), Truth(app, opts.page_size)
    order = iter(requests)
    async with openai_client(url) as client:

        async def worker() -> None:
            for request in order:
                best = await truth.best(request.prompt)
                served, answer = await send_turn(
                    client, request.prompt, request.max_tokens, run, opts.engine == "vllm"
                )
                if best is not None and answer:
                    run.judged += 1
                    run.misrouted += served < best

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(scenario.clients or opts.clients)))
        run.wall_s = time.perf_counter() - started
    return run


def trace_l1(opts: RouteOptions) -> int:
    """L1 tokens per replica for the trace scenario: the options' number, raised (as
    ``bench trace`` sizes it) to hold two of the longest request."""
    requests = scale(load_trace(DEFAULT_TRACE, opts.trace_requests), opts.page_size, 2)
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    return max(opts.device_tokens, -(-2 * longest // opts.page_size) * opts.page_size)


def prefix_tree_chars(serve_app: str, engine: str) -> int | None:
    """The characters of text Ray's prefix router's tree holds for ``serve_app``'s engine
    replicas (the deployment ``engine``; every replica's, summed); None when the tree is
    not there."""
    from ray.serve._private.constants import SERVE_NAMESPACE

    namespace = f"{SERVE_NAMESPACE}::{serve_app}::{engine}"
    try:
        tree = ray.get_actor("LlmPrefixTreeActor", namespace=namespace)
        counts: Any = ray.get(tree.getattr.remote("tenant_to_char_count"), timeout=30)
    except Exception:  # no such actor: another router, or Ray moved it
        return None
    return int(sum(dict(counts).values()))
