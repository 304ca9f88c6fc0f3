"""What the command line accepts, checked where it enters: argparse ``type=`` functions,
choices; the serve options come from ``hicache_ray.serving.serve_options``. Imports nothing heavy
(``--help`` must stay fast)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from hicache_ray.serving.serve_options import SERVE_OPTIONS

__all__ = [
    "MODEL_PRESETS",
    "SERVE_OPTIONS",
    "Address",
    "add_flags",
    "address",
    "csv_of",
    "device",
    "flag",
    "flag_values",
    "length_range",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "yes_no",
    "positive_int",
]

# Names of hicache_ray.engine.model.PRESETS (a test keeps them equal; importing the presets would
# import torch, and --help must not).
MODEL_PRESETS = ("tiny", "tiny4", "bench")


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


def yes_no(text: str) -> bool:
    """A switch's value: 1/true/yes or 0/false/no (any case); anything else is refused."""
    value = text.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a switch value (use 1/true/yes or 0/false/no)"
    )


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


def flag(name: str, text: str, **argparse_kw: Any) -> dict[str, Any]:
    """Metadata of an options field that is the CLI flag ``--name`` (help ``text``; argparse
    keywords such as ``type`` and ``choices``): :func:`add_flags` makes the flag, showing the
    field's default, and :func:`flag_values` reads it back. Declared once, on the field."""
    return {"flag": (name, text, argparse_kw)}


def add_flags(parser: argparse.ArgumentParser, options: type) -> None:
    """A flag for every field of the dataclass ``options`` declared with :func:`flag`."""
    for field in dataclasses.fields(options):
        if "flag" in field.metadata:
            name, text, kw = field.metadata["flag"]
            if "choices" not in kw:
                kw = {"metavar": name.upper().replace("-", "_"), **kw}
            shown = field.default
            if isinstance(shown, tuple):
                shown = ",".join(map(str, shown))
            parser.add_argument(
                f"--{name}", dest=field.name, default=None, help=f"{text} [{shown}]", **kw
            )


def flag_values(args: argparse.Namespace, options: type) -> dict[str, Any]:
    """The fields of ``options`` whose flags were given."""
    return {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(options)
        if "flag" in field.metadata and getattr(args, field.name, None) is not None
    }
