"""``bench pd``: prefill and decode apart, joined by L3, beside one colocated deployment.

A pair (:class:`~actors.pd.PDDeployment`; prefill TP ``prefill_tp``, decode TP
``decode_tp``, the ray store) and then one colocated deployment of TP ``decode_tp`` with
as many CPUs in all (no L3: it computes every prompt) serve the same work:

1. ``requests`` long prompts (``prompt_tokens`` each), one after another. The pair splits
   them. ``pd.handoff_share``: from the prefill side's answer to the decode side's first
   token, less the decode side's forward passes, over the TTFT at the caller (median).
   ``pd.wrong_outputs``: greedy tokens that differ from the colocated deployment's.
2. Each conversation's next turn: the first turn, its answer and ``follow_tokens`` new
   tokens. The pair splits it again; its prefill side finds the answer's pages in L3,
   where the decode side backed them up. ``pd.next_turn_hit_share``: the tokens the
   prefill side found cached, over the first turn's tokens the decode side stored.
3. ``decoders`` short streams decoding ``decoder_tokens`` tokens each while two more long
   prompts arrive. ``pd.itl_p99_vs_colocated``: the p99 gap between the streams' tokens on
   the pair, over the same on the colocated deployment.

Where the host has a core per rank of both sides, the sides run on separate cores (the
prefill side's ranks on the first ``prefill_tp``, the decode side's on the next
``decode_tp``; ``DeploymentConfig.cpu_cores``) and the colocated deployment on all of
them; ``pd.pinned`` says whether they were.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from actors.deployment import Deployment
from actors.pd import PDConfig, PDDeployment, PDResult
from actors.stores import drop_store
from apps.bench.options import PDOptions
from apps.bench.workload import random_tokens
from apps.experiments import embedded_ray, shared_storage
from apps.report import Figure, figure, percentile
from hicache_ray.base.config import CacheConfig, MemoryConfig
from hicache_ray.base.storage_config import RayStorageOptions, StorageConfig
from hicache_ray.engine.model import preset
from hicache_ray.engine.request import GenerateRequest, RequestResult, StreamChunk
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.serving.pd_split import SplitPolicy

__all__ = ["check_result", "pair_config", "run_pd_bench", "stream_gaps"]

_PAGE = 16


def _prompts(opts: PDOptions, vocab: int, n: int, seed: int) -> list[list[int]]:
    return [random_tokens(vocab, opts.prompt_tokens, opts.seed + seed + i) for i in range(n)]


def run_pd_bench(opts: PDOptions, log: Callable[[str], None]) -> list[Figure]:
    """The figures of one run (see the module docstring)."""
    policy = SplitPolicy(min_uncached_tokens=1024, min_uncached_share=0.15)
    config, cores = pair_config(opts, policy, log)
    model = config.decode.model
    longs = _prompts(opts, model.vocab_size, opts.requests, 0)
    arriving = _prompts(opts, model.vocab_size, 2, 1000)
    with embedded_ray(opts.prefill_tp + opts.decode_tp + 1):
        try:
            pair = PDDeployment.launch(config)
            try:
                split = _pair_work(pair, opts, longs, arriving, log)
            finally:
                pair.shutdown()
            cpus = (opts.prefill_tp + opts.decode_tp) / opts.decode_tp
            colocated = msgspec.structs.replace(
                config.decode,
                name=f"{config.decode.name}-colocated",
                cpus_per_rank=cpus,
                cpu_cores=cores,
                cache=CacheConfig(memory=config.decode.cache.memory, storage=StorageConfig()),
            )
            alone = _colocated_work(colocated, opts, longs, arriving)
        finally:
            drop_store(config.decode.cache.storage.ray.name)
    return [*_figures(split, alone, log), figure("pd.pinned", float(bool(cores)), "bool")]


def pair_config(
    opts: PDOptions, policy: SplitPolicy, log: Callable[[str], None]
) -> tuple[PDConfig, tuple[int, ...]]:
    """The pair ``bench pd`` runs (a store of its own), its sides pinned to cores of their
    own where the host has enough; those cores (() when not pinned)."""
    model = preset(opts.model)
    store = f"bench-pd-{os.getpid()}"
    tokens = 2 * (opts.prompt_tokens + opts.follow_tokens) + opts.decoders * 256
    memory = MemoryConfig(page_size=_PAGE, device_tokens=tokens)
    storage = shared_storage(f"reference/{model.name}", RayStorageOptions(name=store))
    cache = CacheConfig(memory=memory, storage=storage)
    base = DeploymentConfig(name=f"bench-pd-{os.getpid()}", model=model, cache=cache)
    sizes = {"prefill_tp": opts.prefill_tp, "decode_tp": opts.decode_tp}
    config = PDConfig.pair(base, policy=policy, **sizes)
    cores = _cores(opts.prefill_tp + opts.decode_tp)
    if cores:
        config = msgspec.structs.replace(
            config,
            prefill=msgspec.structs.replace(config.prefill, cpu_cores=cores[: opts.prefill_tp]),
            decode=msgspec.structs.replace(config.decode, cpu_cores=cores[opts.prefill_tp :]),
        )
    log(f"pd: sides pinned to cores {cores}" if cores else "pd: too few cores to pin the sides")
    return config, cores


def _cores(n: int) -> tuple[int, ...]:
    """``n`` cores this process may use, lowest first; () when it has fewer (or the OS
    cannot pin)."""
    if not hasattr(os, "sched_getaffinity"):
        return ()
    allowed = sorted(os.sched_getaffinity(0))
    return tuple(allowed[:n]) if len(allowed) >= n else ()


def _pair_work(
    pair: PDDeployment,
    opts: PDOptions,
    longs: list[list[int]],
    arriving: list[list[int]],
    log: Callable[[str], None],
) -> dict[str, Any]:
    firsts: list[PDResult] = []
    for i, prompt in enumerate(longs):
        out = pair.generate([GenerateRequest(f"long-{i}", prompt, opts.new_tokens)])[0]
        check_result(out.result)
        log(
            f"pd: request {i}: split {out.split}, TTFT {out.ttft_s * 1e3:.0f} ms (prefill "
            f"{out.prefill_s * 1e3:.0f}, handoff {out.handoff_s * 1e3:.0f}, decode forward "
            f"{out.result.ttft_split.forward_s * 1e3:.0f} ms), {out.handoff_pages} pages handed"
        )
        firsts.append(out)
    shares = []
    for i, (prompt, first) in enumerate(zip(longs, firsts, strict=True)):
        pair.decode.wait_idle(timeout_s=300)  # the first turn's pages are in L3
        new = random_tokens(pair.config.decode.model.vocab_size, opts.follow_tokens, 500 + i)
        follow = prompt + first.result.output_tokens + new
        turn = pair.generate([GenerateRequest(f"turn2-{i}", follow, opts.new_tokens)])[0]
        check_result(turn.result)
        stored = (len(prompt) + len(first.result.output_tokens) - 1) // _PAGE * _PAGE
        shares.append(min(1.0, turn.prefill_cached_tokens / stored) if turn.split else 0.0)
    vocab = pair.config.decode.model.vocab_size
    itl = asyncio.run(_itl(pair.generate_async, pair.stream, opts, arriving, vocab))
    return {"firsts": firsts, "shares": shares, "itl": itl}


def _colocated_work(
    config: DeploymentConfig, opts: PDOptions, longs: list[list[int]], arriving: list[list[int]]
) -> dict[str, Any]:
    dep = Deployment.launch(config)
    try:
        results = [
            dep.generate([GenerateRequest(f"long-{i}", p, opts.new_tokens)])[0]
            for i, p in enumerate(longs)
        ]
        for r in results:
            check_result(r)
        vocab = config.model.vocab_size
        itl = asyncio.run(_itl(dep.generate_async, dep.stream, opts, arriving, vocab))
    finally:
        dep.shutdown()
    return {"results": results, "itl": itl}


async def _itl(
    generate: Any, stream: Any, opts: PDOptions, arriving: list[list[int]], vocab: int
) -> list[float]:
    """Gaps (s) between the tokens of ``decoders`` short streams while ``arriving``'s long
    prompts are served beside them."""
    gaps: list[float] = []

    async def decoder(i: int) -> None:
        tokens = random_tokens(vocab, 64, 9000 + i)
        gaps.extend(
            await stream_gaps(stream(GenerateRequest(f"dec-{i}", tokens, opts.decoder_tokens)))
        )

    async def long(i: int, prompt: list[int]) -> None:
        out = await generate(GenerateRequest(f"arrive-{i}", prompt, opts.new_tokens))
        check_result(out.result if isinstance(out, PDResult) else out)

    await asyncio.gather(
        *(decoder(i) for i in range(opts.decoders)),
        *(long(i, p) for i, p in enumerate(arriving)),
    )
    return gaps


async def stream_gaps(chunks: AsyncIterator[StreamChunk]) -> list[float]:
    """The seconds between one stream's tokens (a chunk of k tokens: k gaps of a k-th
    each); raises when its request failed."""
    gaps: list[float] = []
    last = 0.0
    async for chunk in chunks:
        if chunk.result is not None:
            check_result(chunk.result)
        now = time.perf_counter()
        if chunk.tokens and last:
            gaps.extend([(now - last) / len(chunk.tokens)] * len(chunk.tokens))
        if chunk.tokens:
            last = now
    return gaps


def check_result(result: RequestResult) -> None:
    """Raise when a bench request failed (a figure over failed requests would lie)."""
    if result.error is not None:
        raise RuntimeError(f"bench request {result.rid} failed: {result.error}")


def _figures(
    split: dict[str, Any], alone: dict[str, Any], log: Callable[[str], None]
) -> list[Figure]:
    firsts: list[PDResult] = split["firsts"]
    handoff = [
        (f.ttft_s - f.prefill_s - f.result.ttft_split.forward_s) / f.ttft_s
        for f in firsts
        if f.split and f.ttft_s > 0
    ]
    wrong = sum(
        f.result.output_tokens != r.output_tokens
        for f, r in zip(firsts, alone["results"], strict=True)
    )
    itl_split = percentile(split["itl"], 99) * 1e3
    itl_alone = percentile(alone["itl"], 99) * 1e3
    ttft_split = statistics.median(f.ttft_s for f in firsts) * 1e3
    ttft_alone = statistics.median(r.caller_ttft_s for r in alone["results"]) * 1e3
    log(
        f"pd: TTFT split {ttft_split:.0f} ms, colocated {ttft_alone:.0f} ms; decode ITL p99 "
        f"split {itl_split:.1f} ms, colocated {itl_alone:.1f} ms; {wrong} wrong outputs"
    )
    return [
        figure(
            "pd.handoff_share",
            statistics.median(handoff) if handoff else 1.0,
            "x",
            target=0.1,
            better="lower",
        ),
        figure("pd.ttft_ms.split", ttft_split, "ms", better="lower"),
        figure("pd.ttft_ms.colocated", ttft_alone, "ms", better="lower"),
        figure(
            "pd.itl_p99_vs_colocated",
            itl_split,
            "ms",
            ceiling=itl_alone,
            target=0.5,
            better="lower",
        ),
        figure("pd.wrong_outputs", float(wrong), "requests", target=0.0, better="lower"),
        figure("pd.next_turn_hit_share", statistics.median(split["shares"]), "x"),
    ]
