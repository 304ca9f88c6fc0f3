"""The plot of ``hicache-ray bench serve``: per mode, throughput and latency percentiles."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from apps.report import Figure

__all__ = ["plot_serve"]


def plot_serve(figures: Sequence[Figure], modes: Sequence[str], path: str | Path) -> bool:
    """Requests/s per mode, and TTFT / inter-token latency p50-p99 per mode; False when
    matplotlib is not installed (nothing written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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
