"""Options of ``bench faults`` and ``bench soak``, each field that is a CLI flag declared
once with :func:`~apps.cli_args.flag` (light: ``--help`` imports this module)."""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.cli_args import MODEL_PRESETS, csv_of, flag, positive_float, positive_int

__all__ = ["FAULT_SCENARIOS", "FaultOptions", "SoakOptions"]

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
