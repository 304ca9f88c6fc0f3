"""Per-round summaries of a multi-turn run, their table, figures and plot.

A *series* is one mode of ``bench multiturn`` (``none``, ``l1``, ``l1_l2``, ``l1_l2_l3``) or
one deployment of the demo (``tp2``, ``tp4``); each holds, per round, the results of the
requests it served and the hit tokens the oracle gives those requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from apps.report import Figure, figure, percentile
from hicache_ray.engine.request import RequestResult

__all__ = ["RoundSummary", "Series", "figures", "plot", "rows", "table"]

TIERS = ("l1", "l2", "l3")


@dataclass
class RoundSummary:
    """One round of one series (the requests served in it). ``round`` counts from 0 here;
    every table, plot, progress line and JSON row shows it counted from 1."""

    round: int
    results: list[RequestResult]
    prompts: list[list[int]]
    oracle_hit_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def ttft_ms(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the round's TTFT, in ms."""
        return percentile([r.ttft_s * 1e3 for r in self.results], q)

    def hits(self, tier: str) -> int:
        """Hit tokens by tier: L1 device hits, L2 host hits not from L3, L3 hits."""
        if tier == "l1":
            return sum(r.device_hit_tokens for r in self.results)
        if tier == "l2":
            return sum(r.host_hit_tokens - r.storage_hit_tokens for r in self.results)
        return sum(r.storage_hit_tokens for r in self.results)

    @property
    def hit_tokens(self) -> int:
        return sum(r.device_hit_tokens + r.host_hit_tokens for r in self.results)

    @property
    def recomputed(self) -> int:
        return sum(r.recomputed_tokens for r in self.results)

    @property
    def moved_bytes(self) -> int:
        return sum(r.load_bytes + r.prefetch_bytes for r in self.results)


@dataclass
class Series:
    name: str
    rounds: list[RoundSummary] = field(default_factory=list)
    oracle_target: float | None = None  # applies to measured / oracle hit tokens

    @property
    def results(self) -> list[RequestResult]:
        return [r for s in self.rounds for r in s.results]

    def total(self, attr: str) -> int:
        return sum(getattr(s, attr) for s in self.rounds)

    def oracle_ratio(self) -> float | None:
        oracle = self.total("oracle_hit_tokens")
        return self.total("hit_tokens") / oracle if oracle else None


def table(series: Sequence[Series]) -> str:
    """Per series and round: TTFT p50/p90, hits per tier, recomputed tokens, MiB moved,
    measured / oracle hit tokens."""
    head = (
        "series",
        "round",
        "reqs",
        "p50 ms",
        "p90 ms",
        "L1",
        "L2",
        "L3",
        "recomp",
        "MiB",
        "/oracle",
    )
    rows: list[tuple[str, ...]] = [head]
    for s in series:
        for r in s.rounds:
            ratio = r.hit_tokens / r.oracle_hit_tokens if r.oracle_hit_tokens else None
            rows.append(
                (
                    s.name,
                    str(r.round + 1),
                    str(len(r.results)),
                    f"{r.ttft_ms(50):.1f}",
                    f"{r.ttft_ms(90):.1f}",
                    *(str(r.hits(t)) for t in TIERS),
                    str(r.recomputed),
                    f"{r.moved_bytes / 2**20:.1f}",
                    "-" if ratio is None else f"{ratio:.3f}",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def rows(series: Sequence[Series]) -> list[dict[str, object]]:
    """The JSON rows of the table: one per series and round (rounds counted from 1)."""
    out: list[dict[str, object]] = []
    for s in series:
        for r in s.rounds:
            out.append(
                {
                    "series": s.name,
                    "round": r.round + 1,
                    "requests": len(r.results),
                    "prompt_tokens": r.prompt_tokens,
                    "ttft_p50_ms": r.ttft_ms(50),
                    "ttft_p90_ms": r.ttft_ms(90),
                    **{f"hit_tokens_{t}": r.hits(t) for t in TIERS},
                    "recomputed_tokens": r.recomputed,
                    "moved_bytes": r.moved_bytes,
                    "oracle_hit_tokens": r.oracle_hit_tokens,
                }
            )
    return out


def figures(series: Sequence[Series], infinite_hit_tokens: int) -> list[Figure]:
    """``multiturn.<series>.*`` figures and the infinite-cache ceiling."""
    out = []
    for s in series:
        results = s.results
        ttft = [r.ttft_s * 1e3 for r in results]
        prompt = s.total("prompt_tokens")
        prefill_s = sum(r.ttft_s for r in results)
        out += [
            figure(f"multiturn.{s.name}.ttft_p50_ms", percentile(ttft, 50), "ms", better="lower"),
            figure(f"multiturn.{s.name}.ttft_p90_ms", percentile(ttft, 90), "ms", better="lower"),
            figure(f"multiturn.{s.name}.ttft_p99_ms", percentile(ttft, 99), "ms", better="lower"),
            figure(
                f"multiturn.{s.name}.prefill_tokens_per_s",
                prompt / prefill_s if prefill_s else 0.0,
                "tokens/s",
            ),
        ]
        out += [
            figure(f"multiturn.{s.name}.hit_tokens.{t}", sum(r.hits(t) for r in s.rounds), "tokens")
            for t in TIERS
        ]
        ratio = s.oracle_ratio()
        if ratio is not None:
            out.append(
                figure(f"multiturn.{s.name}.oracle_ratio", ratio, "ratio", target=s.oracle_target)
            )
    out.append(figure("multiturn.infinite_cache.hit_tokens", infinite_hit_tokens, "tokens"))
    return out


def plot(series: Sequence[Series], path: str | Path, title: str) -> bool:
    """TTFT p50 per round by series, and hit tokens per tier stacked; False when matplotlib
    is not installed (nothing written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for s in series:
        style = "o--" if s.name.endswith("nocache") else "o-"
        rounds = [r.round + 1 for r in s.rounds]
        left.plot(rounds, [r.ttft_ms(50) for r in s.rounds], style, label=s.name)
    left.set(xlabel="round", ylabel="TTFT p50 (ms)", title="time to first token")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_ylim(bottom=0)
    left.legend()
    bottom = [0.0] * len(series)
    names = [s.name for s in series]
    for tier in TIERS:
        values = [float(sum(r.hits(tier) for r in s.rounds)) for s in series]
        right.bar(names, values, bottom=bottom, label=tier.upper())
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.bar(
        names, [float(s.total("recomputed")) for s in series], bottom=bottom, label="recomputed"
    )
    right.set(ylabel="prompt tokens", title="where prompt tokens came from")
    right.set_ylim(bottom=0)
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
