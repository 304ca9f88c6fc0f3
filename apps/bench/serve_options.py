"""What ``bench serve`` runs and what one client saw of one turn, and the figures of a mode
(shared by the Python API and the HTTP runs). Light: the CLI reads the defaults for
``--help``; the report helpers load on use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from apps.multiturn.options import ExperimentOptions
from hicache_ray.base.config import PrefetchConfig

if TYPE_CHECKING:
    from apps.report import Figure
    from hicache_ray.engine.request import TTFTSplit

__all__ = ["SERVE_MODES", "ServeOptions", "Turn", "mode_figures"]

SERVE_MODES = ("none", "l1_l2", "l1_l2_l3")


@dataclass(frozen=True)
class ServeOptions:
    """The workload (``experiment`` holds the trace, capacities and policies) and load."""

    experiment: ExperimentOptions = field(
        default_factory=lambda: ExperimentOptions(
            clients=16,
            rounds=4,
            # the demo's system prompt: prefill dominates a turn as it does for real chat
            # prompts (with 512 tokens decode bounded the speedup on 2 cores)
            system_len=1024,
            user="48-64",
            answer="16-24",
            device_tokens=16384,
            host_ratio=2.0,
            page_size=16,
            prefetch_threshold=PrefetchConfig().threshold_tokens,  # what a server runs with
        )
    )
    rate: float = 0.0  # turns per second (0: closed loop)
    modes: tuple[str, ...] = SERVE_MODES
    batch_running: int = 16  # requests running at once for the batching speedup
    decode_tokens: int = 48  # generated per request in the batching measurement
    overload_factor: int = 4  # clients per request the pool holds, in the overload run
    http: bool = False  # also through the OpenAI endpoint (``apps.bench.serve_http_bench``)
    # One untimed request of the shared system prompt before the clients start, in every
    # mode: a server's system prompt is cached from earlier traffic (without it, 16 clients
    # arriving at once all compute the same 1,024 tokens in round 1)
    warm_up: bool = True

    @classmethod
    def quick(cls) -> ServeOptions:
        small = ExperimentOptions(
            clients=4,
            rounds=2,
            system_len=32,
            user="8-12",
            answer="4-6",
            model="tiny4",
            page_size=4,
            device_tokens=1024,
        )
        return cls(experiment=small, batch_running=8, decode_tokens=8, overload_factor=4)


@dataclass
class Turn:
    """What one client saw of one turn."""

    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    queue_s: float = 0.0
    failed: bool = False
    split: TTFTSplit | None = None  # where the TTFT went on rank 0 (Python API only)


def mode_figures(mode: str, turns: list[Turn], wall: float) -> list[Figure]:
    """The figures ``serve.{mode}.*`` of one mode's turns."""
    from apps.report import figure, percentile, split_figures

    done = [t for t in turns if not t.failed]
    ttft = [t.ttft_s * 1e3 for t in done]
    itl = [g * 1e3 for t in done for g in t.itl_s]
    name = f"serve.{mode}"
    return [
        figure(f"{name}.requests_per_s", len(done) / wall, "req/s"),
        figure(f"{name}.output_tokens_per_s", sum(t.tokens for t in done) / wall, "tok/s"),
        figure(f"{name}.ttft_p50_ms", percentile(ttft, 50), "ms", better="lower"),
        figure(f"{name}.ttft_p90_ms", percentile(ttft, 90), "ms", better="lower"),
        figure(f"{name}.ttft_p99_ms", percentile(ttft, 99), "ms", better="lower"),
        figure(f"{name}.itl_p50_ms", percentile(itl, 50), "ms", better="lower"),
        figure(
            f"{name}.queue_wait_p50_ms",
            percentile([t.queue_s * 1e3 for t in done], 50),
            "ms",
            better="lower",
        ),
        figure(
            f"{name}.failed_requests", len(turns) - len(done), "requests", target=0, better="lower"
        ),
        # none over HTTP: the client sees no split
        *split_figures(name, [t.split for t in done if t.split is not None]),
    ]
