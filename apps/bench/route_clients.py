"""The clients of ``bench route``: multi-turn conversations through the OpenAI endpoint,
closed loop, and what each turn shows of the routing (what it was served from cache, and
whether a replica held more of its prompt than the one it reached).

The truth a turn is judged against is the application's cache index (every replica's L1
and L2 pages from its own events, :mod:`actors.routing`), asked just before the turn is
sent; every router's replicas publish to it, so all routers are judged alike.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.index_actor import index_actor
from apps.bench.options import RouteOptions
from apps.bench.serve_http_bench import openai_client
from apps.bench.trace_clients import new_tokens
from apps.bench.workload import random_tokens
from hicache_ray.keys import page_hashes

__all__ = [
    "ENGINE_DEPLOYMENTS",
    "RouteRun",
    "Scenario",
    "Truth",
    "converse",
    "reform_one_engine",
    "restart_one_engine",
    "send_turn",
]

SERVED = "bench"
TIERS = ("l1", "l2", "l3")  # usage.prompt_tokens_details.hicache


@dataclass(frozen=True)
class Scenario:
    """One way of running the conversations.

    Attributes:
        name: ``base``, ``ingresses``, ``restart``, ``pressure``, ``tiers``, ``hot``,
            ``burst``, ``reform`` or ``trace``.
        conversations: how many (0: the options' number).
        clients: concurrent clients (0: the options' number).
        shared_len: tokens of one system prompt that every conversation starts with (0:
            none); the first conversation's first turn then runs alone, so that prompt is
            on one replica (and in the L3) before the others arrive.
        storage: the replicas' shared L3 (``none`` or ``ray``).
        burst: with ``shared_len``, the conversations come in groups of ``burst``
            siblings, each group with its own shared prompt, and a group's first turns
            arrive at once (one group after another) instead.
        reform_after: rounds after which one engine replica's rank 0 is killed: the
            replica keeps its id and re-forms its deployment, caches empty (0: never).
        ingresses: HTTP ingress replicas, each routing with its own router instance.
        restart_after: rounds after which one engine replica is killed and replaced, its
            caches lost (0: never); the clients pause at that round's end, so no turn is
            cut.
        trace: the trace's first ``trace`` requests instead of conversations (0: none).
        device_tokens: L1 tokens per replica (0: the options' number).
    """

    name: str
    conversations: int = 0
    ingresses: int = 1
    restart_after: int = 0
    clients: int = 0
    shared_len: int = 0
    storage: str = "none"
    burst: int = 0
    reform_after: int = 0
    trace: int = 0
    device_tokens: int = 0


@dataclass
class RouteRun:
    """What the clients saw behind one router in one scenario."""

    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tiers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    failed: int = 0
    judged: int = 0  # turns whose best replica the index could tell
    misrouted: int = 0  # of those, turns served less of their prefix than the best held
    served_by: dict[str, int] = field(default_factory=dict)  # turns per engine replica
    wall_s: float = 0.0
    tree_chars: int | None = None  # Ray's prefix router: its tree's text at the end
    turns: list[dict[str, Any]] = field(default_factory=list)  # one record per turn
    answers: list[tuple[list[int], list[int]]] = field(default_factory=list)  # prompt, answer
    started: float = field(default_factory=time.perf_counter)


class Truth:
    """The index's answer to: how many leading prompt tokens does the best replica hold?"""

    def __init__(self, app: str, page_size: int) -> None:
        self._app, self._page_size = app, page_size
        self._index: Any = None

    async def best(self, prompt: list[int]) -> int | None:
        """Tokens the best replica could serve from L1 + L2 (the last prompt token is
        always computed); None when the index cannot tell."""
        try:
            if self._index is None:  # made here if no router made it (prefix, pow2)
                self._index = index_actor(self._app)
            live = await asyncio.to_thread(_live_replicas)  # not a killed one's leftovers
            hits = await self._index.hits.remote(live, page_hashes(prompt, self._page_size))
        except Exception:  # restarting with its maker: asked for again next turn
            self._index = None
            return None
        pages = max((h.device + h.host for h in hits.values()), default=0)
        return min(pages * self._page_size, (len(prompt) - 1) // self._page_size * self._page_size)


async def send_turn(
    client: Any, prompt: list[int], max_new: int, run: RouteRun, vllm: bool = False
) -> tuple[int, list[int]]:
    """One streamed turn: the tokens it was served from cache (L1 + L2; vLLM's cached
    tokens with ``vllm``) and its answer's token ids (empty when it failed).

    This library's engine reads the prompt as text (its ids, which Ray's prefix router
    reads too); vLLM gets the ids and answers greedy with the ids beside its text
    (:mod:`apps.bench.trace_clients`)."""
    text, start, ttft, served = "", time.perf_counter(), None, 0
    replica, tiers, ids = "", dict[str, Any](), list[int]()
    greedy = {"temperature": 0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    try:
        stream = await client.completions.create(
            model=SERVED,
            prompt=prompt if vllm else " ".join(map(str, prompt)),
            max_tokens=max_new,
            stream=True,
            stream_options={"include_usage": True},
            **(greedy if vllm else {}),
        )
        async for chunk in stream:
            piece, new = new_tokens(chunk, vllm)
            if (new if vllm else piece) and ttft is None:
                ttft = time.perf_counter() - start
            text, ids = text + piece, ids + new
            if chunk.usage is not None:
                run.prompt_tokens += chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details else 0
                run.cached_tokens += cached
                tiers = (details.model_extra or {}).get("hicache", {}) if details else {}
                for tier in TIERS:
                    run.tiers[tier] += int(tiers.get(tier, 0))
                served = cached if vllm else int(tiers.get("l1", 0)) + int(tiers.get("l2", 0))
                replica = str(tiers.get("replica", ""))
                run.served_by[replica] = run.served_by.get(replica, 0) + 1
    except Exception as e:  # a failed turn is counted, never raised: the run goes on
        print(f"route: a turn of {len(prompt)} tokens failed: {e}", file=sys.stderr)
        run.failed += 1
        return 0, []
    run.ttft_s.append(ttft if ttft is not None else time.perf_counter() - start)
    run.turns.append(
        {
            "start_s": round(start - run.started, 3),
            "prompt_tokens": len(prompt),
            "ttft_s": round(run.ttft_s[-1], 4),
            "replica": replica,
            **{t: int(tiers.get(t, 0)) for t in TIERS},
        }
    )
    answer = ids if vllm else [int(t) for t in text.split()]
    run.answers.append((prompt, answer))
    return served, answer


async def converse(
    url: str, opts: RouteOptions, scenario: Scenario, app: str, vocab: int, restart: Any
) -> RouteRun:
    """Every conversation of ``scenario``, a turn each per round, ``opts.clients`` at a
    time in a seeded random order; ``restart()`` (a blocking call, run off the event loop)
    before round ``restart_after``."""
    run, truth = RouteRun(), Truth(app, opts.page_size)
    count = scenario.conversations or opts.conversations
    history = [
        _shared(scenario, vocab, c) + random_tokens(vocab, opts.system_len, 1000 + c)
        for c in range(count)
    ]
    async with openai_client(url) as client:

        async def turn(round_: int, c: int) -> None:
            user = random_tokens(vocab, opts.user_len, 10_000 * (round_ + 1) + c)
            prompt = history[c] + user
            best = await truth.best(prompt)
            vllm = opts.engine == "vllm"
            served, answer = await send_turn(client, prompt, opts.answer_len, run, vllm)
            history[c] = prompt + answer
            if best is not None and answer:
                run.judged += 1
                run.misrouted += served < best

        async def client_loop(round_: int, order: list[int]) -> None:
            while order:
                await turn(round_, order.pop())

        cut = scenario.restart_after or scenario.reform_after or opts.rounds
        started = time.perf_counter()
        for round_ in range(opts.rounds):
            if round_ == cut:
                await asyncio.to_thread(restart)
            if round_ == 0 and scenario.shared_len and scenario.burst:
                for first in range(0, count, scenario.burst):  # each group's siblings at once
                    group = range(first, min(count, first + scenario.burst))
                    await asyncio.gather(*(turn(round_, c) for c in group))
                continue
            # NOTE: each round's turns come in a seeded random order, taken by whichever
            # client is free: a fixed rotation (client k, always the same conversations
            # in the same order) locks the load pattern to the conversations, and power
            # of two choices then keeps sending a conversation where it went before.
            order = list(range(count))
            random.Random(round_).shuffle(order)
            if round_ == 0 and scenario.shared_len:  # the shared prompt reaches one replica
                await turn(round_, order.pop())
            clients = scenario.clients or opts.clients
            await asyncio.gather(*(client_loop(round_, order) for _ in range(clients)))
        run.wall_s = time.perf_counter() - started
    return run


def _shared(scenario: Scenario, vocab: int, c: int) -> list[int]:
    """The shared prompt conversation ``c`` starts with (its group's, with ``burst``)."""
    if not scenario.shared_len:
        return []
    group = c // scenario.burst if scenario.burst else 0
    return random_tokens(vocab, scenario.shared_len, 999 - group)


def reform_one_engine(app: str) -> None:
    """Kill rank 0 of one engine replica of Serve application ``app``'s deployments: the
    replica keeps its id and re-forms its ranks at its next request, caches empty."""
    prefix = f"hicache-{app}-"
    ranks = sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == "hicache"
        and a["name"].startswith(prefix)
        and a["name"].endswith("-rank0")
    )
    if not ranks:
        raise RuntimeError(f"no rank of {app}'s engine replicas to kill")
    ray.kill(ray.get_actor(ranks[0], namespace="hicache"), no_restart=True)


# The engine replicas' deployment: this library's (``hicache-ray serve``), or Ray LLM's
# vLLM replicas (``HiCacheLLMServer:`` and the served name, as Ray LLM names them).
ENGINE_DEPLOYMENTS = ("hicache-engine", f"HiCacheLLMServer:{SERVED}")


def _engines() -> list[str]:
    """The actor names of the live engine replicas (``SERVE_REPLICA::app#deployment#id``)."""
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == "serve" and any(f"#{d}#" in a["name"] for d in ENGINE_DEPLOYMENTS)
    )


def _live_replicas() -> list[str]:
    """The replica ids (as the index knows them) of the live engine replicas."""
    return [name.rsplit("#", 1)[-1] for name in _engines()]


def restart_one_engine(app: str, replicas: int, timeout_s: float = 300.0) -> None:
    """Kill one engine replica of Serve application ``app`` and wait until Serve has
    replaced it (``replicas`` running again, the new one's deployment up)."""
    from ray import serve

    before = _engines()
    ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        deployments = status.deployments if status else {}
        engine = next((deployments[d] for d in ENGINE_DEPLOYMENTS if d in deployments), None)
        now = _engines()
        states = {
            str(getattr(k, "value", k)): n
            for k, n in (engine.replica_states if engine else {}).items()
        }
        # NOTE: right after the kill Serve may still count the dead replica as running:
        # done only once a new replica is there and running.
        replaced = set(now) - set(before)
        if states == {"RUNNING": replicas} and before[0] not in now and replaced:
            return
        time.sleep(0.5)
    raise TimeoutError(f"Serve did not replace the killed engine replica in {timeout_s:.0f} s")
