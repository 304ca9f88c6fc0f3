"""Flags of ``hicache-ray demo``, ``bench multiturn`` and ``bench serve``, and their options.

Every flag defaults to None so the value used is, in order: the flag as given, the
``--quick`` run's value, the options' default. ``--quick`` never overrides a flag given.
Only argparse and the light ``cli_args`` are imported at module level (``--help`` is fast).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, get_args

from apps.cli_args import (
    MODEL_PRESETS,
    csv_of,
    length_range,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from hicache_ray.base.config import PrefetchPolicy, WritePolicy
from hicache_ray.base.errors import ConfigError

__all__ = [
    "QUICK",
    "add_experiment_flags",
    "add_serve_bench_flags",
    "experiment_options",
    "serve_options",
]

_MODES = ("none", "l1", "l1_l2", "l1_l2_l3")
_SERVE_MODES = ("none", "l1_l2", "l1_l2_l3")
_WRITE: tuple[str, ...] = get_args(WritePolicy)
_PREFETCH: tuple[str, ...] = get_args(PrefetchPolicy)
# What --quick changes (a test-sized run: the tiny model, short conversations).
QUICK: dict[str, Any] = {
    "clients": 3,
    "rounds": 2,
    "continue_rounds": 1,
    "system_len": 32,
    "user": "8-16",
    "answer": "4-8",
    "model": "tiny4",
    "page_size": 4,
    "device_tokens": 256,
    "check": 2,
}
# The flags of ExperimentOptions' fields (their defaults are shown in --help).
_FLAGS = (
    "clients",
    "rounds",
    "continue_rounds",
    "system_len",
    "user",
    "answer",
    "rate",
    "concurrency",
    "model",
    "page_size",
    "device_tokens",
    "host_ratio",
    "storage",
    "write_policy",
    "prefetch_policy",
    "check",
    "seed",
)


@functools.cache
def _defaults() -> dict[str, Any]:
    from apps.multiturn.options import ExperimentOptions

    return {f.name: f.default for f in dataclasses.fields(ExperimentOptions) if f.name in _FLAGS}


def _flag(
    p: argparse.ArgumentParser, name: str, text: str, quick: dict[str, Any], **kw: Any
) -> None:
    default = _defaults().get(name)
    shown = f" [{default}" + (f"; --quick: {quick[name]}]" if name in quick else "]")
    p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=text + shown, **kw)


def add_experiment_flags(p: argparse.ArgumentParser, *, demo: bool) -> None:
    """Workload, capacity and policy flags of the demo and ``bench multiturn``."""
    p.add_argument("--json", metavar="PATH", help="also write the report here (docs/cli.md)")
    p.add_argument("--png", metavar="PATH", help="the plot (default: the JSON path as .png)")
    p.add_argument("--quick", action="store_true", help="a test-sized run (tiny4 model)")
    _flag(p, "clients", "conversations", QUICK, type=positive_int)
    _flag(
        p,
        "rounds",
        "rounds on TP=2" if demo else "rounds per conversation",
        QUICK,
        type=positive_int,
    )
    if demo:
        _flag(p, "continue_rounds", "rounds continued on TP=4", QUICK, type=non_negative_int)
    _flag(p, "system_len", "tokens of the shared system prompt", QUICK, type=non_negative_int)
    _flag(p, "user", 'tokens per user turn, "N" or "LOW-HIGH"', QUICK, type=length_range)
    _flag(p, "answer", 'tokens per answer, "N" or "LOW-HIGH"', QUICK, type=length_range)
    _flag(p, "rate", "requests per second (0: each round at once)", QUICK, type=non_negative_float)
    _flag(p, "concurrency", "requests in flight", QUICK, type=positive_int)
    _flag(p, "model", "reference model preset", QUICK, choices=MODEL_PRESETS)
    _flag(p, "page_size", "tokens per KV page", QUICK, type=positive_int)
    _flag(p, "device_tokens", "L1 tokens per rank", QUICK, type=positive_int)
    _flag(p, "host_ratio", "L2 size as a multiple of L1", QUICK, type=positive_float)
    _flag(p, "storage", "the L3 backend", QUICK, choices=("ray", "file"))
    p.add_argument("--storage-root", default="", help="root of the file backend (dir or URI)")
    _flag(p, "write_policy", "L1 -> L2 write policy", QUICK, choices=_WRITE)
    _flag(p, "prefetch_policy", "L3 prefetch policy", QUICK, choices=_PREFETCH)
    if not demo:
        p.add_argument("--tp", type=positive_int, default=1, help="TP size")
        p.add_argument("--pp", type=positive_int, default=1, help="PP size")
        p.add_argument("--modes", type=csv_of(_MODES), default=_MODES, help="a subset, A,B")
    _flag(p, "check", "requests re-run from scratch (exactness)", QUICK, type=non_negative_int)
    p.add_argument("--keep-store", action="store_true", help="keep the run's ray L3 store")
    _flag(p, "seed", "seed of the trace", QUICK, type=int)


def experiment_options(args: argparse.Namespace) -> Any:
    """The :class:`ExperimentOptions` of the flags, checked (``ConfigError`` otherwise)."""
    from apps.multiturn.options import ExperimentOptions

    demo = args.command == "demo"
    given = {
        name: getattr(args, name)
        for name in (*_FLAGS, "storage_root")
        if getattr(args, name, None) is not None
    }
    chosen = {**(QUICK if args.quick else {}), **given}
    if not demo:
        chosen.update(tp_size=args.tp, pp_size=args.pp, modes=args.modes, continue_rounds=0)
    else:
        chosen["modes"] = ()
        chosen.setdefault("continue_rounds", 2)
    opts = ExperimentOptions(**chosen, keep_store=args.keep_store)
    if demo:
        dataclasses.replace(opts, modes=("none",)).validate(tp_sizes=(2, 4))
    else:
        opts.validate()
    return opts


def add_serve_bench_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``bench serve`` (defaults: ``ServeOptions`` and its ``quick()``)."""
    from apps.bench.serve_options import ServeOptions

    full, quick = ServeOptions(), ServeOptions.quick()
    exp, small = full.experiment, quick.experiment

    def shown(a: object, b: object) -> str:
        return f" [{a}" + (f"; --quick: {b}]" if b != a else "]")

    p.add_argument("--json", metavar="PATH", help="also write the report here (docs/cli.md)")
    p.add_argument("--png", metavar="PATH", help="the plot (default: the JSON path as .png)")
    p.add_argument("--quick", action="store_true", help="a test-sized run (tiny4 model)")
    clients = "concurrent conversations" + shown(exp.clients, small.clients)
    p.add_argument("--clients", type=positive_int, help=clients)
    rounds = "turns per conversation" + shown(exp.rounds, small.rounds)
    p.add_argument("--rounds", type=positive_int, help=rounds)
    rate = "turns released per second; 0: closed loop" + shown(full.rate, quick.rate)
    p.add_argument("--rate", type=non_negative_float, help=rate)
    modes = "a subset, A,B" + shown(",".join(full.modes), ",".join(quick.modes))
    p.add_argument("--modes", type=csv_of(_SERVE_MODES), help=modes)
    model = "reference model" + shown(exp.model, small.model)
    p.add_argument("--model", choices=MODEL_PRESETS, help=model)
    tp = "TP size of every deployment" + shown(exp.tp_size, small.tp_size)
    p.add_argument("--tp", type=positive_int, help=tp)
    p.add_argument(
        "--http",
        action="store_true",
        help="also run the clients through the OpenAI endpoint (none and l1_l2_l3 modes; "
        "needs the openai package) and compare with the Python API",
    )


def serve_options(args: argparse.Namespace) -> Any:
    """The :class:`ServeOptions` of the flags, checked."""
    from apps.bench.serve_options import ServeOptions

    opts = ServeOptions.quick() if args.quick else ServeOptions()
    given = {
        "clients": args.clients,
        "rounds": args.rounds,
        "model": args.model,
        "tp_size": args.tp,
    }
    exp = dataclasses.replace(opts.experiment, **{k: v for k, v in given.items() if v is not None})
    exp.validate()
    if args.http and args.rate:
        raise ConfigError("--http", True, "the HTTP clients run closed loop", "drop --rate")
    return dataclasses.replace(
        opts,
        experiment=exp,
        modes=args.modes or opts.modes,
        rate=opts.rate if args.rate is None else args.rate,
        http=args.http,
    )
