"""``bench runtime`` on deployments: what an L1 hit costs besides its forward at TP 2 and 4.

Each TP size gets a deployment (Ray actors, one per rank, on an embedded local Ray unless
one is connected) with no L3. A prompt's prefix is served once, then prompts of the same
prefix and new tokens, one at a time: every one an L1 hit. The TTFT split comes from rank
0 (``RequestResult.ttft_split``); ``runtime.hit_rest_ms.tp{N}`` is the p50 of what the caller
waited besides the forward and the loads (``caller_ttft_s - forward_s - load_s``);
``runtime.hit_rest_rank_ms.tp{N}`` the old figure, rank 0's own ``rest``.
The client also sees the Ray calls to rank 0 and back: ``runtime.l1_client_ttft_ms.tp{N}``
is the TTFT measured around ``Deployment.generate`` beside the rank's own.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from actors.deployment import Deployment
from apps.bench.workload import random_tokens
from apps.experiments import embedded_ray
from apps.report import Figure, figure, percentile, split_figures
from hicache_ray.base.config import CacheConfig, MemoryConfig, WriteConfig
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.engine.model import ModelConfig
from hicache_ray.engine.request import GenerateRequest, RequestResult
from hicache_ray.engine.spec import DeploymentConfig

__all__ = ["deployment_figures"]


def deployment_figures(
    model: ModelConfig,
    tp_sizes: tuple[int, ...],
    length: int,
    new_tokens: int,
    page_size: int,
    hits: int,
    log: Callable[[str], None],
) -> list[Figure]:
    """The figures of each TP size in ``tp_sizes`` (none when empty)."""
    figures: list[Figure] = []
    if not tp_sizes:
        return figures
    with embedded_ray(max(tp_sizes)):
        for tp in tp_sizes:
            cache = CacheConfig(
                memory=MemoryConfig(page_size=page_size, device_tokens=4 * (length + new_tokens)),
                write=WriteConfig(policy="write_back"),
                storage=StorageConfig(backend="none"),
            )
            name = f"bench-runtime-tp{tp}-{os.getpid()}"
            config = DeploymentConfig(name=name, model=model, tp_size=tp, cache=cache)
            results, client = _l1_hits(Deployment.launch(config), length, new_tokens, hits)
            figures += _figures(tp, results, client, log)
    return figures


def _l1_hits(
    dep: Deployment, length: int, new_tokens: int, hits: int
) -> tuple[list[RequestResult], list[float]]:
    """The results of ``hits`` L1 hits one at a time, and each one's TTFT at the client."""
    vocab = dep.config.model.vocab_size
    prefix = random_tokens(vocab, length, length)
    results, client = [], []
    try:
        dep.generate([GenerateRequest("warm", prefix + random_tokens(vocab, new_tokens, 1), 1)])
        dep.wait_idle(timeout_s=120)  # the prefix is inserted on every rank
        for i in range(hits + 1):  # the first warms the path up
            request = GenerateRequest(
                f"hit{i}", prefix + random_tokens(vocab, new_tokens, 2 + i), 1
            )
            started = time.perf_counter()
            result = dep.generate([request])[0]
            if result.error is not None:
                raise RuntimeError(f"bench request failed: {result.error}")
            if i:
                results.append(result)
                client.append(time.perf_counter() - started)
            dep.wait_idle(timeout_s=120)
    finally:
        dep.shutdown()
    return results, client


def _figures(
    tp: int, results: list[RequestResult], client: list[float], log: Callable[[str], None]
) -> list[Figure]:
    # The rest on the caller's clock: its TTFT less the forward and the loads (an L1 hit
    # moves no bytes); the rank's own rest (rank 0's clock, the old figure) beside it.
    rest = percentile(
        [(r.caller_ttft_s - r.ttft_split.forward_s - r.ttft_split.load_s) * 1e3 for r in results],
        50,
    )
    rank_rest = percentile([r.ttft_split.rest_s * 1e3 for r in results], 50)
    rank = statistics.median(r.ttft_s * 1e3 for r in results)
    forward = statistics.median(r.ttft_split.forward_s * 1e3 for r in results)
    seen = statistics.median(client) * 1e3
    log(
        f"runtime: TP={tp} L1 hit TTFT {seen:.1f} ms at the client, {rank:.1f} ms on rank 0 "
        f"(forward {forward:.1f} ms; rest {rest:.1f} ms at the caller, {rank_rest:.1f} on rank 0)"
    )
    return [
        *split_figures(f"runtime.l1_tp{tp}", [r.ttft_split for r in results]),
        figure(
            f"runtime.hit_rest_ms.tp{tp}",
            rest,
            "ms",
            target=10.0 if tp <= 2 else None,
            better="lower",
        ),
        figure(f"runtime.hit_rest_rank_ms.tp{tp}", rank_rest, "ms", better="lower"),
        figure(f"runtime.l1_client_ttft_ms.tp{tp}", seen, "ms", ceiling=rank, better="lower"),
    ]
