"""Flags and handlers of ``hicache-ray demo`` and ``hicache-ray bench multiturn`` (both run
deployments on Ray: ``actors`` is imported when they run)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["add_experiment_flags", "run_experiment"]

_DEMO_HELP = (
    "the main job: a multi-turn chat on a TP=2 deployment, continued on TP=4 from L3, on an "
    "embedded local Ray"
)


def add_experiment_flags(p: argparse.ArgumentParser, *, demo: bool) -> None:
    """Workload, capacity and policy flags (defaults: :class:`ExperimentOptions`)."""
    from hicache_ray.multiturn.options import ExperimentOptions

    d = ExperimentOptions()
    p.add_argument("--json", metavar="PATH", help="write the report (schema in README)")
    p.add_argument("--png", metavar="PATH", help="plot path (default: the JSON path as .png)")
    p.add_argument("--clients", type=int, default=d.clients, help="conversations")
    rounds_help = "rounds on TP=2" if demo else "rounds per conversation"
    p.add_argument("--rounds", type=int, default=d.rounds, help=rounds_help)
    if demo:
        p.add_argument("--continue-rounds", type=int, default=d.continue_rounds, help="on TP=4")
    p.add_argument("--system-len", type=int, default=d.system_len, help="shared system prompt")
    p.add_argument("--user", default=d.user, help='user turn tokens: "N" or "LOW-HIGH"')
    p.add_argument("--answer", default=d.answer, help='answer tokens: "N" or "LOW-HIGH"')
    p.add_argument("--rate", type=float, default=d.rate, help="requests/s (0: all at once)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight")
    p.add_argument("--model", default=d.model, help="reference model preset (tiny, bench)")
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--device-tokens", type=int, default=d.device_tokens, help="L1 per rank")
    p.add_argument("--host-ratio", type=float, default=d.host_ratio, help="L2 / L1 size")
    p.add_argument("--storage", default=d.storage, choices=["ray", "file"], help="L3 backend")
    p.add_argument("--storage-root", default="", help="file backend root")
    p.add_argument("--write-policy", default=d.write_policy)
    p.add_argument("--prefetch-policy", default=d.prefetch_policy)
    if not demo:
        p.add_argument("--tp", type=int, default=d.tp_size)
        p.add_argument("--pp", type=int, default=d.pp_size)
        p.add_argument("--modes", default=",".join(d.modes), help="comma-separated subset")
    p.add_argument("--check", type=int, default=d.check, help="requests re-run from scratch")
    p.add_argument(
        "--keep-store", action="store_true", help="keep the run's ray L3 store (default: dropped)"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--quick", action="store_true", help="a small run (smoke tests)")


def _options(args: argparse.Namespace, demo: bool) -> Any:
    from hicache_ray.multiturn.options import ExperimentOptions

    opts = ExperimentOptions(
        clients=args.clients,
        rounds=args.rounds,
        continue_rounds=getattr(args, "continue_rounds", 0),
        system_len=args.system_len,
        user=args.user,
        answer=args.answer,
        rate=args.rate,
        concurrency=args.concurrency,
        model=args.model,
        page_size=args.page_size,
        device_tokens=args.device_tokens,
        host_ratio=args.host_ratio,
        storage=args.storage,
        storage_root=args.storage_root,
        write_policy=args.write_policy,
        prefetch_policy=args.prefetch_policy,
        tp_size=getattr(args, "tp", 1),
        pp_size=getattr(args, "pp", 1),
        modes=tuple(getattr(args, "modes", "none").split(",")) if not demo else (),
        check=args.check,
        seed=args.seed,
        keep_store=args.keep_store,
    )
    if args.quick:  # small enough for a test: the tiny model, short conversations
        opts = dataclasses.replace(
            opts,
            clients=3,
            rounds=2,
            continue_rounds=1 if demo else 0,
            system_len=32,
            user="8-16",
            answer="4-8",
            model="tiny4",
            page_size=4,
            device_tokens=256,
            check=2,
        )
    return opts


def run_experiment(
    args: argparse.Namespace,
    demo: bool,
    finish: Callable[[argparse.Namespace, str, dict[str, object], list[Any]], int],
    log: Callable[[str], None],
) -> int:
    from actors.experiments import run_demo, run_multiturn_bench
    from hicache_ray.multiturn.report import plot

    opts = _options(args, demo)
    run = run_demo if demo else run_multiturn_bench
    series, figures = run(opts, log)
    command = "demo" if demo else "bench multiturn"
    status = finish(args, command, dataclasses.asdict(opts), figures)
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        title = "hicache-ray demo: TP=2 then TP=4" if demo else "hicache-ray bench multiturn"
        if plot(series, png, title):
            log(f"wrote {png}")
        else:
            log("matplotlib is not installed: no plot")
    wrong = next(f for f in figures if f.name == "multiturn.exactness.wrong_outputs")
    return status or (1 if wrong.value else 0)


def add_serve_bench_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``bench serve``; unset ones take :class:`ServeOptions`' defaults (or, with
    ``--quick``, the quick run's), so ``--quick`` never overrides an explicit flag."""
    p.add_argument("--json", metavar="PATH", help="write the report (schema in README)")
    p.add_argument("--png", metavar="PATH", help="plot path (default: the JSON path as .png)")
    p.add_argument("--quick", action="store_true", help="a small run on the tiny4 model (tests)")
    p.add_argument("--clients", type=int, help="concurrent conversations [16; quick 4]")
    p.add_argument("--rounds", type=int, help="turns per conversation [4; quick 2]")
    p.add_argument("--rate", type=float, help="turns released per second; 0: closed loop [0]")
    p.add_argument("--modes", help="comma-separated subset of none,l1_l2,l1_l2_l3 [all]")
    p.add_argument("--model", help="reference model preset [bench; quick tiny4]")
    p.add_argument("--tp", type=int, help="TP size of every deployment [1]")


def run_serve_bench_cli(
    args: argparse.Namespace,
    finish: Callable[[argparse.Namespace, str, dict[str, object], list[Any]], int],
    log: Callable[[str], None],
) -> int:
    from actors.serve_bench import SERVE_MODES, ServeOptions, run_serve_bench
    from hicache_ray.bench.serve_plot import plot_serve

    opts = ServeOptions.quick() if args.quick else ServeOptions()
    exp = opts.experiment
    overrides = {
        "clients": args.clients,
        "rounds": args.rounds,
        "model": args.model,
        "tp_size": args.tp,
    }
    exp = dataclasses.replace(exp, **{k: v for k, v in overrides.items() if v is not None})
    modes = tuple(args.modes.split(",")) if args.modes else opts.modes
    unknown = sorted(set(modes) - set(SERVE_MODES))
    if unknown:
        raise SystemExit(f"hicache-ray bench serve: unknown modes {unknown}; use {SERVE_MODES}")
    opts = dataclasses.replace(
        opts, experiment=exp, modes=modes, rate=opts.rate if args.rate is None else args.rate
    )
    figures = run_serve_bench(opts, log)
    status = finish(args, "bench serve", dataclasses.asdict(opts), figures)
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        log(f"wrote {png}" if plot_serve(figures, modes, png) else "no matplotlib: no plot")
    return status
