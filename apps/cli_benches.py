"""The benchmark commands that report figures with targets (``bench faults``, ``soak``,
``route``, ``trace``, ``pd``), and the report writing every command shares: the table, the
JSON report, a PNG beside it, and exit 1 when a target is missed."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from apps.cli_args import flag_values

__all__ = [
    "bench_faults",
    "bench_pd",
    "bench_route",
    "bench_soak",
    "bench_trace",
    "finish",
    "log",
    "missed",
    "plotted",
]


def log(message: str) -> None:
    print(message, flush=True)


def finish(
    args: argparse.Namespace,
    command: str,
    config: dict[str, Any],
    figures: list[Any],
    rows: list[dict[str, Any]] | None = None,
) -> int:
    """Print the figures table and write the JSON report when asked."""
    from apps.report import Report, machine_info

    report = Report(
        command=command, machine=machine_info(), config=config, figures=figures, rows=rows or []
    )
    log(report.table())
    if args.json:
        report.write(args.json)
        log(f"wrote {args.json}")
    return 0


def missed(figures: list[Any]) -> int:
    return 1 if any(f.meets is False for f in figures) else 0


def bench_faults(args: argparse.Namespace, _: None) -> int:
    from apps.bench.faults_bench import run_faults
    from apps.bench.options import FaultOptions

    opts = FaultOptions(**flag_values(args, FaultOptions))
    figures = run_faults(opts, log)
    return finish(args, "bench faults", dataclasses.asdict(opts), figures) or missed(figures)


def bench_soak(args: argparse.Namespace, _: None) -> int:
    from apps.bench.options import SoakOptions
    from apps.bench.soak import run_soak

    opts = SoakOptions(**flag_values(args, SoakOptions))
    figures = run_soak(opts, log)
    return finish(args, "bench soak", dataclasses.asdict(opts), figures) or missed(figures)


def bench_route(args: argparse.Namespace, _: None) -> int:
    from apps.bench.options import RouteOptions
    from apps.bench.route_bench import run_route_bench
    from apps.bench.serve_plot import plot_route

    base = RouteOptions.quick_options() if args.quick else RouteOptions()
    opts = dataclasses.replace(base, **flag_values(args, RouteOptions))
    figures = run_route_bench(opts, log)
    return plotted(
        args,
        "bench route",
        opts,
        figures,
        lambda png: plot_route(figures, opts.replicas, opts.routers, png),
    )


def plotted(
    args: argparse.Namespace,
    command: str,
    opts: Any,
    figures: list[Any],
    draw: Callable[[Path], bool],
) -> int:
    """:func:`finish`, then with ``--json`` a PNG beside it; exit 1 when a target is missed."""
    status = finish(args, command, dataclasses.asdict(opts), figures)
    if args.json:
        png = Path(args.json).with_suffix(".png")
        log(f"wrote {png}" if draw(png) else "no matplotlib: no plot")
    return status or missed(figures)


def bench_trace(args: argparse.Namespace, _: None) -> int:
    from apps.bench.serve_plot import plot_trace
    from apps.bench.trace_bench import run_trace_bench
    from apps.bench.trace_options import TraceOptions

    base = TraceOptions.quick_options() if args.quick else TraceOptions()
    opts = dataclasses.replace(base, **flag_values(args, TraceOptions))
    figures = run_trace_bench(opts, log)
    return plotted(
        args, "bench trace", opts, figures, lambda png: plot_trace(figures, list(opts.modes), png)
    )


def bench_pd(args: argparse.Namespace, _: None) -> int:
    from apps.bench.options import PDOptions
    from apps.bench.pd_bench import run_pd_bench
    from apps.bench.serve_plot import plot_pd

    if args.faults:
        from apps.bench.pd_faults import PD_FAULT_SCENARIOS, run_pd_faults

        found, rows = run_pd_faults(log)
        config = {"faults": True, "scenarios": list(PD_FAULT_SCENARIOS)}
        return finish(args, "bench pd", config, found, rows) or missed(found)
    opts = PDOptions(**flag_values(args, PDOptions))
    if args.sweep:
        from apps.bench import pd_sweep

        found = pd_sweep.run_pd_sweep(opts, log)
        config = {
            **dataclasses.asdict(opts),
            "sweep": True,
            "sweep_tokens": list(pd_sweep.SWEEP_TOKENS),
            "sweep_shares": list(pd_sweep.SWEEP_SHARES),
            "share_tail": pd_sweep.SHARE_TAIL,
        }
        return finish(args, "bench pd", config, found) or missed(found)
    figures = run_pd_bench(opts, log)
    return plotted(args, "bench pd", opts, figures, lambda png: plot_pd(figures, png))
