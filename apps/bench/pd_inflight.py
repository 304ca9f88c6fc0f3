"""``bench pd --sweep``, its last part: how much work the prefill side may have queued
before a request is prefilled where it decodes (``SplitPolicy.max_inflight_tokens``).

A burst of ``BURST_PROMPTS`` uncached prompts of ``BURST_TOKENS`` tokens arrives at once
while ``decoders`` short streams decode on the decode side (each stream a run of requests
until the burst is answered). The burst is served once with the split off (every prompt
prefilled where it decodes, as on a colocated deployment) and once per cap in
``INFLIGHT_CAPS`` (a request that would take the prefill side's queue past the cap is
prefilled on the decode side). Per run: the burst's TTFT p50 / p90 at the caller, the
streams' inter-token gap p99, and the share of the burst split.

The two costs pull apart: every prompt prefilled on the decode side stalls its streams
for that prefill (``bench pd``'s ITL target: p99 at most half the colocated one), while
every prompt queued on the prefill side waits for those ahead of it. So:

* ``pd.sweep.inflight.min_cap``: the smallest cap at which the streams' p99 meets the ITL
  target against the split-off run (the largest cap when none does);
* ``pd.sweep.inflight.drain_s``: how long the prefill side takes to compute
  ``SplitPolicy().max_inflight_tokens`` at the pace measured here (the smallest cap's run,
  where a split prompt has nothing ahead of it), against ``wait_max_s``: a queue that
  takes longer than decode waits for a handoff is work thrown away.

The default cap stands where both hold: at least ``min_cap``, drained within the wait.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from actors.pd import PDConfig, PDDeployment, PDResult
from apps.bench.options import PDOptions
from apps.bench.pd_bench import check_result, stream_gaps
from apps.bench.workload import random_tokens
from apps.report import Figure, figure, percentile
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.serving.pd_split import SplitPolicy

__all__ = ["BURST_PROMPTS", "BURST_TOKENS", "INFLIGHT_CAPS", "ITL_TARGET", "inflight_runs"]

BURST_TOKENS = 2048
BURST_PROMPTS = 8
INFLIGHT_CAPS = tuple(k * BURST_TOKENS for k in (1, 2, 4, 8))
ITL_TARGET = 0.5  # bench pd's: the streams' p99 gap at most half the colocated one
_STREAM_PROMPT = 64


class Burst(NamedTuple):
    """One run: the burst's TTFTs (ms), how many were split, the streams' gaps (ms), and
    the seconds per 1,024 tokens the prefill side took for its first split prompt."""

    ttft_ms: list[float]
    split: int
    gaps_ms: list[float]
    pace_per_1k_s: float


def inflight_runs(
    pair: PDDeployment, opts: PDOptions, log: Callable[[str], None]
) -> dict[int | None, Burst]:
    """The burst served with the split off (key None) and under each cap (module
    docstring), on ``pair``'s deployments."""
    runs: dict[int | None, Burst] = {}
    base = SplitPolicy(min_uncached_tokens=BURST_TOKENS, min_uncached_share=0.0)
    for n, cap in enumerate((None, *INFLIGHT_CAPS)):
        policy = (
            msgspec.structs.replace(base, enabled=False)
            if cap is None
            else msgspec.structs.replace(base, max_inflight_tokens=cap)
        )
        config = msgspec.structs.replace(pair.config, policy=policy)
        view = PDDeployment(config, pair.prefills, pair.decode)
        try:
            runs[cap] = asyncio.run(_burst(view, opts, opts.seed + 100_003 * (n + 1)))
        finally:
            view.release()
        pair.wait_idle(timeout_s=300)  # its backups done: the next run starts quiet
        row = runs[cap]
        log(
            f"pd sweep: burst, cap {cap if cap is not None else 'off (no split)'}: "
            f"{row.split}/{BURST_PROMPTS} split, TTFT p90 {percentile(row.ttft_ms, 90):.0f} "
            f"ms, stream gap p99 {percentile(row.gaps_ms, 99):.1f} ms"
        )
    return runs


async def _burst(view: PDDeployment, opts: PDOptions, seed: int) -> Burst:
    vocab = view.config.decode.model.vocab_size
    done = asyncio.Event()
    gaps: list[float] = []

    async def stream(i: int) -> None:
        turn = 0
        while not done.is_set():
            tokens = random_tokens(vocab, _STREAM_PROMPT, seed + 10_000 + 97 * i + turn)
            request = GenerateRequest(f"burst-dec-{seed}-{i}-{turn}", tokens, opts.decoder_tokens)
            gaps.extend(g * 1e3 for g in await stream_gaps(view.stream(request)))
            turn += 1

    async def burst() -> list[PDResult]:
        await asyncio.sleep(0)  # the streams have started
        prompts = [random_tokens(vocab, BURST_TOKENS, seed + i) for i in range(BURST_PROMPTS)]
        requests = [GenerateRequest(f"burst-{seed}-{i}", p, 1) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*(view.generate_async(r) for r in requests)))
        finally:
            done.set()

    streams = asyncio.gather(*(stream(i) for i in range(opts.decoders)))
    try:
        outs = await burst()
    finally:
        await streams  # they end with the burst (done is set)
    for out in outs:
        check_result(out.result)
    split = [o for o in outs if o.split]
    pace = min((o.prefill_s for o in split), default=0.0) * 1024 / BURST_TOKENS
    return Burst([o.ttft_s * 1e3 for o in outs], len(split), gaps, pace)


def inflight_figures(
    runs: dict[int | None, Burst], config: PDConfig, log: Callable[[str], None]
) -> list[Figure]:
    """Each run's figures, the smallest cap meeting the ITL target, and how long the
    default cap's queue takes to drain (module docstring)."""
    off = runs[None]
    off_p99 = percentile(off.gaps_ms, 99)
    figures: list[Figure] = []
    for cap, row in runs.items():
        key = f"pd.sweep.inflight.{'off' if cap is None else cap}"
        figures += [
            figure(f"{key}.ttft_p50_ms", statistics.median(row.ttft_ms), "ms", better="lower"),
            figure(f"{key}.ttft_p90_ms", percentile(row.ttft_ms, 90), "ms", better="lower"),
            figure(f"{key}.itl_p99_ms", percentile(row.gaps_ms, 99), "ms", better="lower"),
            figure(f"{key}.split_share", row.split / BURST_PROMPTS, "x"),
        ]
    meeting = [
        cap for cap in INFLIGHT_CAPS if percentile(runs[cap].gaps_ms, 99) <= ITL_TARGET * off_p99
    ]
    least = min(meeting, default=max(INFLIGHT_CAPS))
    pace = runs[INFLIGHT_CAPS[0]].pace_per_1k_s  # one prompt apart at a time: none ahead
    default = SplitPolicy().max_inflight_tokens
    drain = default * pace / 1024
    wait_max = config.policy.wait_max_s
    log(
        f"pd sweep: the streams' p99 gap meets the ITL target from a cap of {least} tokens; "
        f"the default cap ({default}) drains in {drain:.1f} s at the prefill side's pace "
        f"({pace:.2f} s per 1,024 tokens), against a {wait_max:.0f} s handoff wait"
    )
    return [
        *figures,
        figure("pd.sweep.inflight.min_cap", float(least), "tokens", better="lower"),
        figure("pd.sweep.inflight.pace_per_1k_s", pace, "s", better="lower"),
        figure("pd.sweep.inflight.drain_s", drain, "s", ceiling=wait_max, better="lower"),
    ]
