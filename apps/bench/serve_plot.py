"""The plots of ``hicache-ray bench serve`` (per mode, throughput and latency percentiles) and
``bench route`` (per router, cached tokens and TTFT)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from apps.report import Figure

__all__ = ["plot_route", "plot_serve"]


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_serve(figures: Sequence[Figure], modes: Sequence[str], path: str | Path) -> bool:
    """Requests/s per mode, and TTFT / inter-token latency p50-p99 per mode; False when
    matplotlib is not installed (nothing written)."""
    plt = _pyplot()
    if plt is None:
        return False
    value = {f.name: f.value for f in figures}
    modes = [m for m in modes if f"serve.{m}.requests_per_s" in value]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(modes, [value[f"serve.{m}.requests_per_s"] for m in modes])
    left.set(ylabel="requests / s", title="request throughput", ylim=(0, None))
    width = 0.25
    for i, q in enumerate(("p50", "p90", "p99")):
        xs = [j + (i - 1) * width for j in range(len(modes))]
        right.bar(xs, [value[f"serve.{m}.ttft_{q}_ms"] for m in modes], width, label=f"TTFT {q}")
    right.plot(
        range(len(modes)), [value[f"serve.{m}.itl_p50_ms"] for m in modes], "ko", label="ITL p50"
    )
    right.set_xticks(range(len(modes)), modes)
    right.set(ylabel="ms", title="latency seen by clients", ylim=(0, None))
    right.legend()
    speedup = value.get("serve.cache_speedup")
    title = "hicache-ray bench serve"
    if speedup is not None:
        title += f" (cache speedup {speedup:.2f}x"
        batching = value.get("serve.batching_speedup")
        title += f", batching speedup {batching:.2f}x)" if batching is not None else ")"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_route(
    figures: Sequence[Figure], replicas: Sequence[int], routers: Sequence[str], path: str | Path
) -> bool:
    """Cached prompt tokens and TTFT p50 per router, one group per replica count; False
    when matplotlib is not installed (nothing written)."""
    plt = _pyplot()
    if plt is None:
        return False
    value = {f.name: f.value for f in figures}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(routers))
    for i, router in enumerate(routers):
        xs = [j + (i - (len(routers) - 1) / 2) * width for j in range(len(replicas))]
        hits = [value.get(f"route.r{n}.{router}.hit_tokens", 0.0) for n in replicas]
        ttft = [value.get(f"route.r{n}.{router}.ttft_p50_ms", 0.0) for n in replicas]
        left.bar(xs, hits, width, label=router)
        right.bar(xs, ttft, width, label=router)
    labels = [f"{n} replicas" for n in replicas]
    left.set_xticks(range(len(replicas)), labels)
    left.set(ylabel="prompt tokens", title="served from L1 + L2", ylim=(0, None))
    right.set_xticks(range(len(replicas)), labels)
    right.set(ylabel="ms", title="TTFT p50", ylim=(0, None))
    left.legend()
    fig.suptitle("hicache-ray bench route")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_trace(figures: Sequence[Figure], modes: Sequence[str], path: str | Path) -> bool:
    """Hits over the ideal per mode (base and overload runs) and TTFT p50-p99 per mode;
    False when matplotlib is not installed (nothing written)."""
    plt = _pyplot()
    if plt is None:
        return False
    value = {f.name: f.value for f in figures}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for i, run in enumerate(("trace", "trace.overload")):
        shown = [m for m in modes if f"{run}.{m}.hit_vs_ideal" in value]
        xs = [modes.index(m) + (i - 0.5) * width for m in shown]
        left.bar(xs, [value[f"{run}.{m}.hit_vs_ideal"] for m in shown], width, label=run)
        if run == "trace":
            for k, q in enumerate(("p50", "p90", "p99")):
                ys = [value[f"{run}.{m}.ttft_{q}_ms"] for m in shown]
                right.bar(
                    [modes.index(m) + (k - 1) * 0.25 for m in shown], ys, 0.25, label=f"TTFT {q}"
                )
    left.set_xticks(range(len(modes)), modes)
    left.set(
        ylabel="hit tokens / ideal", title="hits over the infinite-cache ideal", ylim=(0, 1.05)
    )
    left.legend()
    right.set_xticks(range(len(modes)), modes)
    right.set(ylabel="ms", title="TTFT seen by clients (base run)", ylim=(0, None))
    right.legend()
    fig.suptitle("hicache-ray bench trace")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_pd(figures: Sequence[Figure], path: str | Path) -> bool:
    """TTFT and decode ITL p99, split against colocated; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    value = {f.name: f for f in figures}
    itl = value["pd.itl_p99_vs_colocated"]
    ttft = [value["pd.ttft_ms.split"].value, value["pd.ttft_ms.colocated"].value]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    sides, colors = ["split", "colocated"], ["tab:blue", "tab:gray"]
    left.bar(sides, ttft, color=colors)
    left.set(ylabel="ms", title="TTFT of a long prompt (median)", ylim=(0, None))
    right.bar(sides, [itl.value, itl.ceiling or 0.0], color=colors)
    right.set(ylabel="ms", title="decode ITL p99 while long prompts arrive", ylim=(0, None))
    fig.suptitle("hicache-ray bench pd")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
