"""Options of ``bench faults``, ``bench soak`` and ``bench route``, each field that is a CLI
flag declared once with :func:`~apps.cli_args.flag` (light: ``--help`` imports this module)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from apps.cli_args import (
    MODEL_PRESETS,
    csv_of,
    flag,
    non_negative_int,
    positive_float,
    positive_int,
)
from hicache_ray.serving.serve_options import ROUTERS

__all__ = [
    "FAULT_SCENARIOS",
    "ROUTE_SCENARIOS",
    "FaultOptions",
    "PDOptions",
    "RouteOptions",
    "SoakOptions",
]

# The scenarios of ``bench route`` (apps.bench.route_bench runs them).
ROUTE_SCENARIOS = (
    "base",
    "ingresses",
    "restart",
    "pressure",
    "tiers",
    "hot",
    "burst",
    "reform",
    "trace",
)

# The scenarios of ``bench faults`` (apps.bench.faults_bench runs them).
FAULT_SCENARIOS = (
    "rank_killed_admit",
    "rank_killed_prefill",
    "rank_killed_decode",
    "rank_stalled",
    "l3_shard_killed",
    "l3_corrupt_pages",
    "l3_write_failures",
    "l3_slow_reads",
)


@dataclass(frozen=True)
class FaultOptions:
    """What ``bench faults`` runs: the scenarios, each on a deployment of its own."""

    scenarios: tuple[str, ...] = field(
        default=FAULT_SCENARIOS,
        metadata=flag("scenarios", "a subset, A,B", type=csv_of(FAULT_SCENARIOS), metavar="A,B"),
    )
    model: str = field(
        default="tiny4", metadata=flag("model", "reference model preset", choices=MODEL_PRESETS)
    )
    tp_size: int = field(
        default=2, metadata=flag("tp", "TP size of the deployments", type=positive_int)
    )
    clients: int = 3
    prompt_len: int = 64
    answer_len: int = 8
    page_size: int = 8
    device_tokens: int = 1024
    consensus_timeout_s: float = 3.0
    seed: int = 0


@dataclass(frozen=True)
class SoakOptions:
    """What ``bench soak`` runs: clients on small pools with faults injected."""

    duration_s: float = field(
        default=60.0, metadata=flag("duration", "seconds of load", type=positive_float)
    )
    clients: int = field(
        default=6, metadata=flag("clients", "concurrent conversations", type=positive_int)
    )
    concurrency: int = 3
    model: str = "tiny4"
    page_size: int = 8
    device_tokens: int = 512
    turn_tokens: int = 24
    answer_tokens: int = 6
    fault_every_s: float = field(
        default=15.0, metadata=flag("fault-every", "seconds between faults", type=positive_float)
    )
    check: int = 8
    seed: int = field(default=0, metadata=flag("seed", "seed of the load and faults", type=int))


def _replica_counts(text: str) -> tuple[int, ...]:
    """Comma-separated replica counts, each 2 to 8 (argparse's type check)."""
    try:
        counts = tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        counts = ()
    if not counts or any(not 2 <= n <= 8 for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: give replica counts 2 to 8, as 2,3")
    return counts


def _route_weights(text: str) -> str:
    """``text`` if the cache router takes it as its weights (argparse's type check)."""
    from hicache_ray.base.errors import ConfigError
    from hicache_ray.serving.serve_options import serve_replicas

    try:
        serve_replicas({"route_weights": text})
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


@dataclass(frozen=True)
class RouteOptions:
    """What ``bench route`` runs: multi-turn conversations through the OpenAI endpoint of
    N replicas, once per router; the conversations' working set exceeds one replica's
    L1 + L2 but not the cluster's. A replica caches ``2 * device_tokens`` (its L2, which
    holds a copy of every L1 page: write-through): 4,096 tokens by default, and the
    conversations end at 536 tokens each (12 of them: 6,432; the pressure scenario's 15:
    8,040, near the 8,192 of two replicas)."""

    routers: tuple[str, ...] = field(
        default=ROUTERS,
        metadata=flag("routers", "a subset, A,B", type=csv_of(ROUTERS), metavar="A,B"),
    )
    scenarios: tuple[str, ...] = field(
        default=ROUTE_SCENARIOS,
        metadata=flag("scenarios", "a subset, A,B", type=csv_of(ROUTE_SCENARIOS), metavar="A,B"),
    )
    replicas: tuple[int, ...] = field(
        default=(2, 3),
        metadata=flag(
            "replicas", "replica counts, each scenario at each", type=_replica_counts, metavar="2,3"
        ),
    )
    engine: str = field(
        default="hicache",
        metadata=flag(
            "engine", "hicache (this library's) or vllm (vLLM replicas, docs/vllm.md)",
            choices=("hicache", "vllm"),
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
    conversations: int = field(
        default=12, metadata=flag("conversations", "conversations", type=positive_int)
    )
    clients: int = field(
        default=4, metadata=flag("clients", "concurrent clients, closed loop", type=positive_int)
    )
    rounds: int = field(default=4, metadata=flag("rounds", "turns each", type=positive_int))
    pressure_conversations: int = 15  # the pressure scenario's: near the cluster's L1 + L2
    hot_shared_len: int = 1024  # the hot scenario's system prompt, the same for every one
    hot_clients: int = 6  # the hot scenario's clients: load near the cluster's capacity
    burst_siblings: int = 6  # the burst scenario's siblings per new shared prompt
    trace_requests: int = field(
        default=200,
        metadata=flag(
            "trace-requests", "the trace scenario: the trace's first N requests", type=positive_int
        ),
    )
    system_len: int = 384  # the first turn's prompt, unique per conversation
    user_len: int = 32
    answer_len: int = 8
    page_size: int = 16
    device_tokens: int = 2048  # L1 per replica; L2 is twice that
    route_weights: str = field(
        default="",
        metadata=flag(
            "route-weights",
            "the cache router's weights, as serve's --route-weights (docs/serving.md)",
            type=_route_weights,
            metavar="l1=1,...",
        ),
    )
    turn_log: str = field(
        default="",
        metadata=flag(
            "turn-log",
            "write every turn (scenario, router, start, TTFT, replica, tokens per tier) "
            "to this JSON Lines file",
            metavar="PATH",
        ),
    )
    check: int = field(
        default=4,
        metadata=flag(
            "check",
            "--engine vllm: each run's first N answers checked against a plain vLLM engine",
            type=non_negative_int,
        ),
    )
    quick: bool = False

    @classmethod
    def quick_options(cls) -> RouteOptions:
        return cls(
            replicas=(2,),
            model="tiny4",
            scenarios=("base", "restart"),
            conversations=6,
            pressure_conversations=8,
            hot_shared_len=64,
            hot_clients=3,
            burst_siblings=3,
            trace_requests=24,
            clients=3,
            rounds=2,
            system_len=64,
            user_len=8,
            answer_len=4,
            page_size=8,
            device_tokens=256,
            quick=True,
        )


def _long_prompt(text: str) -> int:
    """A prompt length of 1,024 to 32,768 tokens (the split needs 1,024 uncached)."""
    value = positive_int(text)
    if not 1024 <= value <= 32768:
        raise argparse.ArgumentTypeError(f"{value} is outside [1024, 32768] tokens")
    return value


@dataclass(frozen=True)
class PDOptions:
    """What ``bench pd`` runs: a prefill/decode pair, then one colocated deployment."""

    model: str = field(
        default="bench", metadata=flag("model", "reference model preset", choices=MODEL_PRESETS)
    )
    prompt_tokens: int = field(
        default=8192,
        metadata=flag("prompt-tokens", "tokens of each long prompt", type=_long_prompt),
    )
    requests: int = field(
        default=3, metadata=flag("requests", "long prompts (and next turns)", type=positive_int)
    )
    prefill_tp: int = field(
        default=1,
        metadata=flag("prefill-tp", "TP size of the prefill side", type=int, choices=(1, 2, 4)),
    )
    decode_tp: int = field(
        default=1,
        metadata=flag("decode-tp", "TP size of the decode side", type=int, choices=(1, 2, 4)),
    )
    new_tokens: int = 8
    follow_tokens: int = 2048
    decoders: int = 2
    decoder_tokens: int = 48
    seed: int = field(default=0, metadata=flag("seed", "seed of the prompts", type=int))
