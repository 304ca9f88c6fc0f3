"""The machine-readable report every ``hicache-ray bench ...`` and ``demo`` writes.

Schema (``schema_version`` 1)::

    {"schema_version": 1, "command": str, "machine": Machine, "config": {str: any},
     "figures": [Figure, ...], "rows": [{str: any}, ...]}

``rows`` (the demo and ``bench multiturn``: one per series and round) is empty elsewhere.

``ratio`` is value / ceiling; ``target`` applies to ``ratio`` when there is a ceiling, else
to ``value``; ``meets`` compares it in the ``better`` direction.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import psutil
import torch

from hicache_ray.base.layout import ModelKV, Shard, ShardKV
from hicache_ray.engine.request import TTFTSplit

__all__ = [
    "Figure",
    "Machine",
    "Report",
    "figure",
    "machine_info",
    "percentile",
    "split_figures",
    "time_into",
    "hit_credit",
]


class Machine(msgspec.Struct, frozen=True, kw_only=True):
    cpu_count: int
    memory_bytes: int
    python: str
    torch: str
    ray: str | None
    accelerator: str


class Figure(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    value: float
    unit: str
    ceiling: float | None
    ratio: float | None
    target: float | None
    better: Literal["higher", "lower"]
    meets: bool | None


class Report(msgspec.Struct, frozen=True, kw_only=True):
    schema_version: int = 1
    command: str
    machine: Machine
    config: dict[str, Any]
    figures: list[Figure]
    rows: list[dict[str, Any]] = msgspec.field(default_factory=list)

    def write(self, path: str | Path) -> None:
        Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=2))

    def table(self) -> str:
        """A fixed-width table of the figures for the terminal."""
        rows = [("figure", "value", "unit", "ceiling", "ratio", "target", "meets")]
        for f in self.figures:
            rows.append(
                (
                    f.name,
                    f"{f.value:.4g}",
                    f.unit,
                    "-" if f.ceiling is None else f"{f.ceiling:.4g}",
                    "-" if f.ratio is None else f"{f.ratio:.3f}",
                    "-" if f.target is None else f"{f.target:g}",
                    {True: "yes", False: "NO", None: "-"}[f.meets],
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank; 0 when empty."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def split_figures(name: str, splits: Sequence[TTFTSplit]) -> list[Figure]:
    """``{name}.ttft_split.{part}_p50_ms`` and ``_p90_ms`` of each part of ``splits``."""
    found = []
    for part in TTFTSplit.__struct_fields__ if splits else ():
        values = [getattr(s, part) * 1e3 for s in splits]
        for q in (50, 90):
            value = percentile(values, q)
            found.append(figure(f"{name}.ttft_split.{part}_p{q}_ms", value, "ms", better="lower"))
    return found


def figure(
    name: str,
    value: float,
    unit: str,
    *,
    ceiling: float | None = None,
    target: float | None = None,
    better: Literal["higher", "lower"] = "higher",
) -> Figure:
    """A figure with its ratio and verdict filled in."""
    ratio = value / ceiling if ceiling else None
    judged = ratio if ceiling else value
    meets = None
    if target is not None and judged is not None:
        meets = judged >= target if better == "higher" else judged <= target
    return Figure(
        name=name,
        value=value,
        unit=unit,
        ceiling=ceiling,
        ratio=ratio,
        target=target,
        better=better,
        meets=meets,
    )


def machine_info() -> Machine:
    try:
        import ray

        ray_version: str | None = ray.__version__
    except ImportError:
        ray_version = None
    if torch.cuda.is_available():
        accel = torch.cuda.get_device_name(0)
    else:
        accel = f"none (CPU: {platform.processor() or platform.machine()})"
    return Machine(
        cpu_count=os.cpu_count() or 1,
        memory_bytes=int(psutil.virtual_memory().total),
        python=platform.python_version(),
        torch=str(torch.__version__),
        ray=ray_version,
        accelerator=accel,
    )


def fp16_kv(
    num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, shard: Shard | None = None
) -> ShardKV:
    """The float16 KV shard of a benchmark model (one rank unless ``shard`` says otherwise)."""
    model = ModelKV(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype="float16"
    )
    return ShardKV(model=model, shard=shard or Shard(), page_size=page_size)


def time_into(fn: Callable[[], object], samples: list[float]) -> None:
    """Run ``fn`` once and append its wall time in seconds to ``samples``."""
    start = time.perf_counter()
    fn()
    samples.append(time.perf_counter() - start)


def hit_credit(hit: float, l1: float, miss: float) -> float:
    """The share of the prefill an L1 hit saves that a hit from another tier saves (TTFTs
    of the same prompt: ``1 - (hit - l1) / (miss - l1)``), the cache router's credit for
    that tier (:class:`~hicache_ray.serving.route_cost.RouteWeights`)."""
    return 1.0 - (hit - l1) / (miss - l1) if miss > l1 else 0.0
