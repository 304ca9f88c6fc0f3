"""Serving a multi-turn trace on deployments: the engine of ``demo`` and ``bench multiturn``.

Rounds run one after the other; within a round every client's request is submitted, at
most ``concurrency`` in flight (the device pool must hold the running requests next to the
cache: requests that cannot get device pages fail rather than wait), either all at once
or with exponential gaps at the trace's ``rate``. Each round's answers extend the
conversations before the next round's prompts are made.
"""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from actors.deployment import Deployment
from apps.multiturn.options import MODES
from apps.multiturn.oracle import OracleRequest, lru_hit_tokens
from apps.multiturn.report import RoundSummary
from apps.multiturn.trace import Trace
from hicache_ray.base.config import CacheConfig, WriteConfig
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.engine.request import GenerateRequest, RequestResult

__all__ = ["MODES", "Progress", "mode_cache", "oracle_hits", "replay_rounds", "serve_rounds"]

_NEVER = 1 << 30  # a hit threshold no node reaches: nothing is ever copied to the host


def mode_cache(mode: str, base: CacheConfig) -> tuple[CacheConfig, bool]:
    """The cache config of ``mode`` derived from ``base`` (which holds the L3 settings),
    and whether prefixes are reused. ``none`` recomputes every prompt; ``l1`` never copies
    to the host (``write_through_selective`` with an unreachable threshold); ``l1_l2`` has
    no L3; ``l1_l2_l3`` is ``base``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {MODES}")
    no_l3 = StorageConfig(backend="none")
    if mode == "none":
        return CacheConfig(memory=base.memory, prefetch=base.prefetch, storage=no_l3), False
    if mode == "l1":
        write = WriteConfig(policy="write_through_selective", hit_threshold=_NEVER)
        return CacheConfig(memory=base.memory, write=write, storage=no_l3), True
    if mode == "l1_l2":
        return CacheConfig(memory=base.memory, write=base.write, storage=no_l3), True
    return base, True


class Progress:
    """One status line per series on stderr: rewritten in place on a terminal; elsewhere
    (a log, a Ray job) a line at least every ``every_s`` seconds and at each round's end.
    Rounds are counted from 1, as in the table, the plot and the JSON rows."""

    def __init__(self, label: str, rounds: int, first: int = 0, every_s: float = 5.0) -> None:
        self.label = label
        self.rounds = rounds
        self.first = first  # the series' first round (the demo's TP=4 continues at 3)
        self.every_s = every_s
        self.tty = sys.stderr.isatty()
        self._last = time.monotonic()

    def update(self, round_: int, done: int, total: int) -> None:
        number = round_ - self.first + 1
        line = f"{self.label}: round {number}/{self.rounds}, {done}/{total} requests"
        now = time.monotonic()
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done == total else ""))
        elif done == total or now - self._last >= self.every_s:
            sys.stderr.write(line + "\n")
            self._last = now
        sys.stderr.flush()


def serve_rounds(
    deployment: Deployment,
    trace: Trace,
    rounds: range,
    *,
    label: str,
    concurrency: int,
    progress: Progress | None = None,
) -> list[RoundSummary]:
    """Serve ``rounds`` of ``trace`` on ``deployment``; one summary per round.

    Raises:
        RuntimeError: a request came back with an error (the run would be meaningless).
    """
    rnd = random.Random(trace.config.seed + 1)
    summaries = []
    for r in rounds:
        prompts = trace.prompts(r)
        results = _serve_round(
            deployment, r, prompts, label, concurrency, trace.config.rate, rnd, progress
        )
        trace.record(r, [x.output_tokens for x in results])
        summaries.append(RoundSummary(r, results, [t for t, _ in prompts]))
    return summaries


def replay_rounds(
    deployment: Deployment,
    served: list[RoundSummary],
    *,
    label: str,
    concurrency: int,
    rate: float,
    seed: int,
    progress: Progress | None = None,
) -> list[RoundSummary]:
    """Serve exactly the prompts (and answer lengths) of rounds already ``served``
    elsewhere, round by round (a baseline on the same requests)."""
    rnd = random.Random(seed + 1)
    out = []
    for summary in served:
        prompts = [
            (prompt, len(result.output_tokens))
            for prompt, result in zip(summary.prompts, summary.results, strict=True)
        ]
        results = _serve_round(
            deployment, summary.round, prompts, label, concurrency, rate, rnd, progress
        )
        out.append(RoundSummary(summary.round, results, list(summary.prompts)))
    return out


def _serve_round(
    deployment: Deployment,
    round_: int,
    prompts: list[tuple[list[int], int]],
    label: str,
    concurrency: int,
    rate: float,
    rnd: random.Random,
    progress: Progress | None,
) -> list[RequestResult]:
    """One round's ``(prompt, answer length)`` requests; every one must succeed.

    Raises:
        RuntimeError: a request came back with an error (the run would be meaningless).
    """
    requests = [
        GenerateRequest(f"{label}-r{round_}-c{c}", tokens, answer)
        for c, (tokens, answer) in enumerate(prompts)
    ]
    results = _serve(deployment, requests, concurrency, rate, rnd, progress, round_)
    bad = [x for x in results if x.error is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) of round {round_} failed: {bad[0].error}")
    return results


def _serve(
    deployment: Deployment,
    requests: list[GenerateRequest],
    concurrency: int,
    rate: float,
    rnd: random.Random,
    progress: Progress | None,
    round_: int,
) -> list[RequestResult]:
    pending = deque(enumerate(requests))
    running: dict[Future[RequestResult], int] = {}
    results: list[Any] = [None] * len(requests)
    done = 0
    while pending or running:
        while pending and len(running) < concurrency:
            if rate:
                time.sleep(rnd.expovariate(rate))  # the arrival process of the trace
            i, request = pending.popleft()
            running[deployment.submit(request)] = i
        # Wakes at least every second, so progress shows even while nothing finishes.
        finished, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
        for future in finished:
            results[running.pop(future)] = future.result()
            done += 1
        if progress is not None:
            progress.update(round_, done, len(requests))
    return results


def oracle_hits(
    rounds: list[RoundSummary],
    capacity_pages: int | None,
    page_size: int,
    concurrency: int,
    rate: float,
) -> list[int]:
    """Per round, the hit tokens an LRU of ``capacity_pages`` (None: unbounded) gets on the
    requests served, admitted as they were: a round's first ``concurrency`` requests
    together, then one by one (one by one throughout under a rate)."""
    waves: list[list[OracleRequest]] = []
    sizes: list[int] = []
    for summary in rounds:
        made = [
            OracleRequest(p, r.output_tokens)
            for p, r in zip(summary.prompts, summary.results, strict=True)
        ]
        first = 1 if rate else concurrency
        round_waves = [made[:first]] + [[x] for x in made[first:]]
        waves += round_waves
        sizes.append(len(round_waves))
    hits = lru_hit_tokens(waves, page_size, capacity_pages)
    out, at = [], 0
    for n in sizes:
        out.append(sum(sum(h) for h in hits[at : at + n]))
        at += n
    return out
