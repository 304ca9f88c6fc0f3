"""What the command line accepts, checked where it enters: argparse ``type=`` functions,
choices; the serve options come from ``hicache_ray.serve_options``. Imports nothing heavy
(``--help`` must stay fast)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from urllib.parse import urlsplit

from hicache_ray.serve_options import SERVE_OPTIONS

__all__ = [
    "FAULT_SCENARIOS",
    "MODEL_PRESETS",
    "SERVE_OPTIONS",
    "Address",
    "address",
    "csv_of",
    "device",
    "length_range",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
]

# Names of hicache_ray.model.PRESETS (a test keeps them equal; importing the presets would
# import torch, and --help must not).
MODEL_PRESETS = ("tiny", "tiny4", "bench")
# Scenarios of apps.bench.faults_bench (a test keeps them equal).
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


def _number(text: str, kind: type[int] | type[float], what: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    value = int(_number(text, int, "an integer"))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive (use 1 or more)")
    return value


def non_negative_int(text: str) -> int:
    value = int(_number(text, int, "an integer"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative (use 0 or more)")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def length_range(text: str) -> str:
    """Token counts: ``N`` or ``LOW-HIGH`` (1 <= LOW <= HIGH)."""
    found = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or LOW-HIGH (e.g. 64-96)")
    low = int(found[1])
    high = int(found[2]) if found[2] else low
    if low < 1 or high < low:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LOW <= HIGH")
    return text.strip()


def csv_of(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated, non-empty subset of ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        unknown = [item for item in items if item not in choices]
        if not items or unknown:
            raise argparse.ArgumentTypeError(
                f"{text!r}: unknown {unknown or 'empty list'}; choose from {','.join(choices)}"
            )
        return items

    return parse


def device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (CUDA is checked before the run starts)."""
    if re.fullmatch(r"auto|cpu|cuda(?::\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, cpu, cuda or cuda:N")
    return text


class Address:
    """Where a running cluster is: ``auto``, ``host:port`` (its GCS), ``ray://host:port``
    (Ray Client) or ``http(s)://host:port`` (its dashboard, as ``ray job submit`` uses)."""

    def __init__(self, text: str, kind: str, host: str = "", port: int = 0) -> None:
        self.text, self.kind, self.host, self.port = text, kind, host, port

    def __repr__(self) -> str:
        return self.text


def address(text: str) -> Address:
    if text == "auto":
        return Address(text, "auto")
    split = urlsplit(text if "://" in text else f"gcs://{text}")
    if split.scheme not in ("gcs", "ray", "http", "https") or not split.hostname:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not auto, HOST:PORT, ray://HOST:PORT or http(s)://HOST:PORT"
        )
    try:
        port = split.port or {"ray": 10001, "http": 80, "https": 443}.get(split.scheme, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} has an invalid port") from None
    if not port:
        raise argparse.ArgumentTypeError(f"{text!r} needs a port (the GCS port, 6379 by default)")
    kind = "dashboard" if split.scheme.startswith("http") else split.scheme
    return Address(text, kind, split.hostname, port)
