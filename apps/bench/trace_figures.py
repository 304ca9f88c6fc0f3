"""The figures of ``bench trace``: per mode, the speedups, the exactness check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from apps.bench.trace_clients import TIERS, Outcome
from apps.bench.trace_data import ScaledRequest
from apps.report import Figure, figure, percentile

__all__ = ["Ideal", "mode_figures", "speedups", "wrong_outputs"]

Runs = dict[str, tuple[list[Outcome], float]]


@dataclass(frozen=True)
class Ideal:
    """Hit tokens of the ideal caches on the replayed prompts (``trace_data``)."""

    infinite: int
    lru: int  # an LRU cache of the run's L1 + L2 capacity, all replicas together
    lru_pages: int


def mode_figures(
    name: str, outcomes: list[Outcome], wall: float, ideal: Ideal, slo_ms: float
) -> list[Figure]:
    """``{name}.*``: hits (all, per tier, over the ideals), latency, rate, SLO, failures."""
    done = [o for o in outcomes if not o.failed]
    hits = sum(o.hit_tokens for o in outcomes)
    ttft = [o.ttft_s * 1e3 for o in done]
    itl = [g * 1e3 for o in done for g in o.itl_s]
    overload, mode = ".overload." in name, name.rsplit(".", 1)[1]
    ideal_target = {"l1_l2_l3": 0.85 if overload else 0.95}.get(mode)
    lru_target = 0.9 if mode == "l1_l2" and not overload else None
    return [
        figure(f"{name}.hit_tokens", hits, "tokens"),
        *(
            figure(f"{name}.hit_tokens.{t}", sum(o.tiers[t] for o in outcomes), "tokens")
            for t in TIERS
        ),
        figure(f"{name}.hit_vs_ideal", hits / max(1, ideal.infinite), "x", target=ideal_target),
        figure(f"{name}.hit_vs_lru_oracle", hits / max(1, ideal.lru), "x", target=lru_target),
        figure(f"{name}.ttft_p50_ms", percentile(ttft, 50), "ms", better="lower"),
        figure(f"{name}.ttft_p90_ms", percentile(ttft, 90), "ms", better="lower"),
        figure(f"{name}.ttft_p99_ms", percentile(ttft, 99), "ms", better="lower"),
        figure(f"{name}.itl_p50_ms", percentile(itl, 50), "ms", better="lower"),
        figure(f"{name}.itl_p99_ms", percentile(itl, 99), "ms", better="lower"),
        figure(f"{name}.requests_per_s", len(done) / wall if wall else 0.0, "req/s"),
        figure(
            f"{name}.slo_attainment", sum(t <= slo_ms for t in ttft) / max(1, len(outcomes)), "x"
        ),
        figure(
            f"{name}.failed_requests",
            len(outcomes) - len(done),
            "requests",
            target=0,
            better="lower",
        ),
    ]


def speedups(prefix: str, runs: Runs) -> list[Figure]:
    """``{prefix}.cache_speedup.ttft_p50`` / ``.ttft_p90``: none's TTFT over l1_l2_l3's."""
    if "none" not in runs or "l1_l2_l3" not in runs:
        return []
    out = []
    for q, target in ((50, None), (90, 2.0)):
        base, cached = (
            [o.ttft_s for o in runs[m][0] if not o.failed] for m in ("none", "l1_l2_l3")
        )
        ratio = percentile(base, q) / max(1e-9, percentile(cached, q))
        out.append(figure(f"{prefix}.cache_speedup.ttft_p{q}", ratio, "x", target=target))
    return out


def wrong_outputs(
    answers: Callable[[list[ScaledRequest]], list[list[int]]],
    requests: list[ScaledRequest],
    runs: Runs,
    check: int,
    log: Callable[[str], None],
) -> list[Figure]:
    """``trace.wrong_outputs``: answers of ``check`` evenly spaced requests, in every mode,
    that differ from what ``answers`` (a no-cache recompute) gives them (a failed request
    is not judged)."""
    if not check:
        return []
    picked = sorted({round(i * (len(requests) - 1) / max(1, check - 1)) for i in range(check)})
    wrong = judged = 0
    for i, want in zip(picked, answers([requests[i] for i in picked]), strict=True):
        for outcomes, _ in runs.values():
            if not outcomes[i].failed:
                judged += 1
                wrong += outcomes[i].output != want
    log(f"exactness: {wrong} wrong of {judged} answers checked against a recompute")
    return [
        figure("trace.wrong_outputs", wrong, "answers", target=0, better="lower"),
        figure("trace.checked_outputs", judged, "answers"),
    ]
