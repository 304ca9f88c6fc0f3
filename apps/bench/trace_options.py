"""Options of ``bench trace``, each flag declared once on its field (light: ``--help``
imports this module; the replay loads on use)."""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.cli_args import (
    MODEL_PRESETS,
    csv_of,
    flag,
    non_negative_int,
    positive_int,
    yes_no,
)
from hicache_ray.serving.serve_options import ROUTERS

__all__ = ["ENGINES", "TRACE_MODES", "TraceOptions"]

TRACE_MODES = ("none", "l1_l2", "l1_l2_l3")
ENGINES = ("hicache", "vllm")


@dataclass(frozen=True)
class TraceOptions:
    """What ``bench trace`` replays, on what, and how fast (docs/cli.md, ``bench trace``).

    Capacities: 0 sizes the cache by the rule printed with the run: a replica's L1 + L2
    (its L2, which holds a copy of every L1 page) holds a quarter of the replayed working
    set, L3 all of it.
    """

    trace: str = field(
        default="", metadata=flag("trace", "JSONL trace (default: the shipped conversation trace)")
    )
    limit: int = field(
        default=80, metadata=flag("limit", "replay the first N requests", type=positive_int)
    )
    block_tokens: int = field(
        default=0,
        metadata=flag(
            "block-tokens", "tokens per trace block (0: the page size)", type=non_negative_int
        ),
    )
    clients: int = field(
        default=4,
        metadata=flag("clients", "closed loop: requests in flight, trace order", type=positive_int),
    )
    time_scale: float = field(
        default=0.0,
        metadata=flag(
            "time-scale", "open loop instead: arrivals divided by S (0: closed loop)", type=float
        ),
    )
    modes: tuple[str, ...] = field(
        default=TRACE_MODES,
        metadata=flag("modes", "a subset, A,B", type=csv_of(TRACE_MODES), metavar="A,B"),
    )
    overload: bool = field(
        default=True,
        metadata=flag(
            "overload",
            "also the open-loop run at 1.5x the none run's capacity (1/0, yes/no)",
            type=yes_no,
        ),
    )
    replicas: int = field(
        default=1, metadata=flag("replicas", "engine replicas over one L3", type=positive_int)
    )
    router: str = field(
        default="cache", metadata=flag("router", "with --replicas > 1", choices=ROUTERS)
    )
    tp_size: int = field(default=1, metadata=flag("tp", "TP size per replica", type=positive_int))
    pp_size: int = field(default=1, metadata=flag("pp", "PP size per replica", type=positive_int))
    engine: str = field(
        default="hicache",
        metadata=flag(
            "engine", "hicache (this library's) or vllm (vLLM replicas, docs/vllm.md)",
            choices=ENGINES,
        ),
    )  # fmt: skip
    model: str = field(
        default="bench",
        metadata=flag(
            "model",
            f"a reference model preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face "
            "checkpoint directory (--engine vllm: a checkpoint)",
        ),
    )
    page_size: int = 16
    device_tokens: int = field(
        default=0,
        metadata=flag(
            "device-tokens", "L1 tokens per rank (0: the sizing rule)", type=non_negative_int
        ),
    )
    host_ratio: float = 2.0
    slo_ttft_ms: float = field(
        default=0.0,
        metadata=flag("slo-ttft-ms", "TTFT SLO (0: twice the none run's median)", type=float),
    )
    check: int = field(
        default=4, metadata=flag("check", "answers re-run from scratch", type=non_negative_int)
    )
    seed: int = 0
    quick: bool = False

    @classmethod
    def quick_options(cls) -> TraceOptions:
        """30 requests on the tiny model, 4-token blocks (smoke tests)."""
        return cls(limit=30, model="tiny4", page_size=4, check=2, quick=True)

    @property
    def block(self) -> int:
        return self.block_tokens or self.page_size
