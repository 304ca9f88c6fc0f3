"""``bench pd --sweep``: from what uncached length, and what uncached share, prefilling apart
stops costing TTFT.

On ``bench pd``'s pair (sides pinned apart where the host allows), prompts are prefilled
twice each way: apart (the prefill side computes the prompt, L3 hands it over, decode
reads it and decodes) and where they decode (the split turned off). Figures are medians.

* Lengths (``SWEEP_TOKENS``, nothing cached): both TTFTs at the caller and the handoff's
  share of the split TTFT (from the prefill side's answer to the first token, less
  decode's forward passes, as ``pd.handoff_share``). ``pd.sweep.min_uncached_tokens`` is
  the shortest length from which on every length's handoff share is at most ``MAX_COST``.
* Shares (``SWEEP_SHARES`` of a prompt whose uncached tail is ``SHARE_TAIL`` tokens, its
  head computed on the decode side first): both TTFTs and the split's extra cost,
  ``(apart - here) / apart`` (the prefill side reads the head from L3 before its tail).
  ``pd.sweep.min_uncached_share`` is the lowest share from which on every share's extra
  cost is at most ``MAX_COST``.

There a split costs a request at most a tenth of its TTFT (the issue's handoff target) and
frees the decode side's running streams of its prefill (``bench pd``'s ITL figure):
``SplitPolicy``'s defaults come from these two figures; ``max_inflight_tokens`` from the
burst that ends the sweep (:mod:`apps.bench.pd_inflight`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import msgspec

from actors.pd import PDDeployment, PDResult
from actors.stores import drop_store
from apps.bench.options import PDOptions
from apps.bench.pd_bench import pair_config
from apps.bench.pd_inflight import inflight_figures, inflight_runs
from apps.bench.workload import random_tokens
from apps.experiments import embedded_ray
from apps.report import Figure, figure
from hicache_ray.engine.request import GenerateRequest
from hicache_ray.serving.pd_split import SplitPolicy

__all__ = ["MAX_COST", "SHARE_TAIL", "SWEEP_SHARES", "SWEEP_TOKENS", "run_pd_sweep"]

SWEEP_TOKENS = (256, 512, 1024, 2048, 4096)
SWEEP_SHARES = (0.25, 0.5, 0.75)
SHARE_TAIL = 2048
MAX_COST = 0.1
_REPEATS = 2


class Row(NamedTuple):
    """One point: TTFT apart and where it decodes (ms), and what the split cost (share)."""

    apart_ms: float
    here_ms: float
    cost: float


def run_pd_sweep(opts: PDOptions, log: Callable[[str], None]) -> list[Figure]:
    """The sweep's figures (see the module docstring)."""
    apart = SplitPolicy(min_uncached_tokens=min(SWEEP_TOKENS), min_uncached_share=0.0)
    longest = max(max(SWEEP_TOKENS), round(SHARE_TAIL / min(SWEEP_SHARES)))
    sized = dataclasses.replace(opts, prompt_tokens=max(opts.prompt_tokens, longest))
    config, cores = pair_config(sized, apart, log)
    here = msgspec.structs.replace(config, policy=msgspec.structs.replace(apart, enabled=False))
    lengths: dict[int, Row] = {}
    shares: dict[float, Row] = {}
    with embedded_ray(opts.prefill_tp + opts.decode_tp + 1):
        try:
            pair = PDDeployment.launch(config)
            local = PDDeployment(here, pair.prefills, pair.decode)
            try:
                for n in SWEEP_TOKENS:
                    lengths[n] = _point(pair, local, 0, n, opts.seed)
                    log(f"pd sweep: {n} uncached tokens: {_says(lengths[n])} (handoff)")
                page = config.decode.cache.memory.page_size
                for share in SWEEP_SHARES:
                    head = round(SHARE_TAIL * (1 - share) / share / page) * page
                    shares[share] = _point(pair, local, head, SHARE_TAIL, opts.seed)
                    log(f"pd sweep: uncached share {share}: {_says(shares[share])} (extra)")
                bursts = inflight_runs(pair, opts, log)
            finally:
                local.release()
                pair.shutdown()
        finally:
            drop_store(config.decode.cache.storage.ray.name)
    return [*_figures(lengths, shares, bool(cores), log), *inflight_figures(bursts, config, log)]


def _says(row: Row) -> str:
    return f"TTFT apart {row.apart_ms:.0f} ms, here {row.here_ms:.0f} ms; cost {row.cost:.3f}"


def _point(pair: PDDeployment, local: PDDeployment, head: int, tail: int, seed: int) -> Row:
    """A prompt of ``head`` tokens the decode side computed first and ``tail`` new ones,
    both ways ``_REPEATS`` times. The cost: the handoff's share of TTFT apart when nothing
    is cached, else what apart took more than here, over apart."""
    vocab = pair.config.decode.model.vocab_size
    apart_ms: list[float] = []
    here_ms: list[float] = []
    handoff: list[float] = []
    for i in range(_REPEATS):
        for way, times in ((pair, apart_ms), (local, here_ms)):
            base = seed + 7919 * (head + tail) + 2 * i + (way is local)
            tokens = random_tokens(vocab, head, base + 1_000_003) if head else []
            if head:  # the decode side holds the head (and backs it up to L3)
                _check(local.generate([GenerateRequest(f"head-{base}", tokens, 1)])[0], False)
                pair.wait_idle(timeout_s=300)
            tokens += random_tokens(vocab, tail, base)
            out = way.generate([GenerateRequest(f"sweep-{base}", tokens, 1)])[0]
            _check(out, split=way is pair)
            times.append(out.ttft_s * 1e3)
            if way is pair:
                forward = out.result.ttft_split.forward_s
                handoff.append((out.ttft_s - out.prefill_s - forward) / out.ttft_s)
            pair.wait_idle(timeout_s=300)  # its backups done: the next one starts quiet
    a, h = statistics.median(apart_ms), statistics.median(here_ms)
    return Row(a, h, statistics.median(handoff) if not head else (a - h) / a)


def _check(out: PDResult, split: bool) -> None:
    if out.result.error is not None:
        raise RuntimeError(f"bench request {out.result.rid} failed: {out.result.error}")
    if out.split != split or (split and out.handoff_missing):
        raise RuntimeError(
            f"bench request {out.result.rid}: split {out.split} ({out.reason}), "
            f"{out.handoff_missing} pages not handed over"
        )


def _least(rows: Mapping[Any, Row], above: Any) -> Any:
    """The lowest key from which on every row's cost is at most ``MAX_COST``; ``above``
    when none is."""
    paying = [k for k in rows if all(rows[m].cost <= MAX_COST for m in rows if m >= k)]
    return min(paying) if paying else above


def _figures(
    lengths: dict[int, Row], shares: dict[float, Row], pinned: bool, log: Callable[[str], None]
) -> list[Figure]:
    figures = []
    for key, row, cost in [
        *((f"pd.sweep.{n}", r, "handoff_share") for n, r in lengths.items()),
        *((f"pd.sweep.share_{s}", r, "extra_share") for s, r in shares.items()),
    ]:
        figures += [
            figure(f"{key}.ttft_apart_ms", row.apart_ms, "ms", better="lower"),
            figure(f"{key}.ttft_here_ms", row.here_ms, "ms", better="lower"),
            figure(f"{key}.{cost}", row.cost, "x", better="lower"),
        ]
    # none pays: twice the longest length, or a share of 1 (only an uncached prompt)
    least = _least(lengths, 2 * max(lengths))
    share = _least(shares, 1.0)
    log(f"pd sweep: a split costs at most {MAX_COST:.0%} of TTFT from {least} uncached tokens")
    log(f"pd sweep: and from an uncached share of {share}")
    return [
        *figures,
        figure("pd.sweep.min_uncached_tokens", float(least), "tokens", better="lower"),
        figure("pd.sweep.min_uncached_share", float(share), "x", better="lower"),
        figure("pd.pinned", float(pinned), "bool"),
    ]
