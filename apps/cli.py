"""hicache-ray: a three-tier KV cache (device, host, storage) for LLM serving on Ray.

Run the demo, serve a model behind an OpenAI-compatible API, inspect a running cluster and
its L3 stores, or benchmark each layer beside its ceiling. `hicache-ray COMMAND --help`
describes each command; docs/cli.md has them all.
"""

from __future__ import annotations

import os

# After each torch op, idle OpenMP threads spin for a while and starve the copy threads
# (L2 -> L1 loads ran ~25 % slower right after a copy_ here). libgomp reads this when
# torch loads, so it is set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from apps.bench.options import FaultOptions, PDOptions, RouteOptions, SoakOptions
from apps.bench.trace_options import TraceOptions
from apps.cli_args import (
    SERVE_OPTIONS,
    add_flags,
    address,
    device,
    positive_float,
    positive_int,
)
from apps.cli_experiments import add_experiment_flags, add_serve_bench_flags

__all__ = ["main"]

_STORAGE_BACKENDS = ("memory", "file", "ray", "sglang", "vllm")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help (unless there is none to show); descriptions
    kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, "") or isinstance(action.default, tuple):
            return action.help
        return super()._get_help_string(action)


def _command(
    sub: Any, name: str, text: str, run: str, prepare: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand whose handler (and optional check, run before anything starts) are
    functions of ``apps.cli_commands``, imported only when it runs."""
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=text, description=text, formatter_class=_Help
    )
    p.set_defaults(run=run, prepare=prepare, parser=p)
    return p


def _report_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="also write the report here (docs/cli.md)")


def _cluster_flags(p: argparse.ArgumentParser, per: str) -> None:
    p.add_argument(
        "--address",
        type=address,
        default="auto",
        help="the cluster: auto, HOST:PORT (GCS), ray://HOST:PORT or http://HOST:PORT "
        "(dashboard; the command then runs there as a Ray job)",
    )
    p.add_argument(
        "--timeout", type=positive_float, default=10.0, help=f"seconds to connect, and per {per}"
    )


def _bench_parsers(sub: Any) -> None:
    bench = sub.add_parser(
        "bench", help="benchmarks that print each figure beside its ceiling", formatter_class=_Help
    )
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    micro = _command(
        bsub,
        "micro",
        "L1<->L2 bandwidth per layout, tree throughput, consensus cost",
        "bench_micro",
    )
    _report_flags(micro)
    micro.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N")
    micro.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads")
    micro.add_argument("--quick", action="store_true", help="small shapes (smoke tests)")
    micro.set_defaults(prepare="check_device")
    _component_benches(bsub)
    _deployment_benches(bsub)


def _component_benches(bsub: Any) -> None:
    storage = _command(
        bsub, "storage", "page hashing; L3 put/get/exists throughput", "bench_storage"
    )
    _report_flags(storage)
    storage.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads")
    storage.add_argument(
        "--backend",
        action="append",
        choices=_STORAGE_BACKENDS,
        help="repeatable (default: memory and file); ray, sglang and vllm use the connected "
        "Ray or start a local one; sglang is the SGLang backend and vllm the vLLM connector's "
        "page moves, both on the ray store",
    )
    storage.add_argument("--root", help="file backend root, a directory or URI (default: temp)")
    storage.add_argument("--quick", action="store_true", help="small pages (smoke tests)")
    runtime = _command(bsub, "runtime", "TTFT per prefix tier; miss overhead", "bench_runtime")
    _report_flags(runtime)
    runtime.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads")
    runtime.add_argument("--quick", action="store_true", help="the tiny model (smoke tests)")
    runtime.add_argument(
        "--profile",
        metavar="PATH",
        help="also profile the run (cProfile of the rank; pstats written here, top 25 by "
        "cumulative time printed)",
    )


def _deployment_benches(bsub: Any) -> None:
    mt = _command(
        bsub,
        "multiturn",
        "multi-turn chat per cache mode vs an LRU oracle",
        "experiment",
        "options",
    )
    add_experiment_flags(mt, demo=False)
    serve = _command(
        bsub,
        "serve",
        "clients under load per cache mode: throughput, TTFT, ITL, batching, overload",
        "serve_bench",
        "serve_bench_options",
    )
    add_serve_bench_flags(serve)
    faults = _command(
        bsub, "faults", "fault scenarios: wrong or failed requests, recovery", "bench_faults"
    )
    _report_flags(faults)
    add_flags(faults, FaultOptions)
    soak = _command(bsub, "soak", "clients, small pools, every tier, faults", "bench_soak")
    _report_flags(soak)
    add_flags(soak, SoakOptions)
    route = _command(
        bsub,
        "route",
        "replicas behind each router (cache, prefix, pow2): cached tokens, TTFT, requests/s",
        "bench_route",
    )
    _report_flags(route)
    add_flags(route, RouteOptions)
    route.add_argument("--quick", action="store_true", help="tiny model, 2 replicas (smoke)")
    trace = _command(
        bsub,
        "trace",
        "a production request trace through the OpenAI app per cache mode, against its ideal",
        "bench_trace",
    )
    _report_flags(trace)
    add_flags(trace, TraceOptions)
    trace.add_argument("--quick", action="store_true", help="30 requests, tiny model (smoke)")
    _pd_bench(bsub)


def _pd_bench(bsub: Any) -> None:
    pd = _command(
        bsub,
        "pd",
        "prefill and decode apart over L3 vs one colocated deployment: handoff, ITL, exactness",
        "bench_pd",
    )
    _report_flags(pd)
    add_flags(pd, PDOptions)
    ways = pd.add_mutually_exclusive_group()
    ways.add_argument(
        "--faults",
        action="store_true",
        help="instead, the fault table: a pair under each fault (docs/serving.md)",
    )
    ways.add_argument(
        "--sweep",
        action="store_true",
        help="instead, TTFT apart vs where it decodes per uncached length (docs/serving.md)",
    )


def _serve_flags(sub: Any) -> None:
    """``hicache-ray serve``: every serve option, the keys, and the HTTP address."""
    serve = _command(
        sub,
        "serve",
        "an OpenAI-compatible server (Ray Serve) for a checkpoint or a preset",
        "serve",
    )
    for name, (default, text) in SERVE_OPTIONS.items():
        serve.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            required=name == "model",
            help=f"{text} [{default}]" if default else text,
        )
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key calls must send (Authorization: Bearer KEY), a tenant of its own; "
        "repeatable; also read from $HICACHE_RAY_API_KEY",
    )
    serve.add_argument("--served-name", default="", help="the model name clients use")
    serve.add_argument("--keep-store", action="store_true", help="keep the L3 store at exit")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP address to bind")
    serve.add_argument("--port", type=positive_int, default=8000, help="HTTP port")
    serve.add_argument("--address", default="", help="Ray cluster (default: a local Ray)")
    serve.set_defaults(prepare="serve_app")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache-ray", description=__doc__, formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = _command(
        sub,
        "demo",
        "the main job: multi-turn chats on a TP=2 deployment continued on TP=4 from L3, each "
        "beside a no-cache baseline, on an embedded local Ray",
        "experiment",
        "options",
    )
    add_experiment_flags(demo, demo=True)
    _serve_flags(sub)
    stats = _command(
        sub, "stats", "JSON of every deployment's ranks and L3 store in a cluster", "stats"
    )
    _cluster_flags(stats, "actor")
    stats.add_argument("--json", metavar="PATH", help="also write the JSON here")
    store = sub.add_parser(
        "store", help="list, clear or drop the ray L3 stores of a cluster", formatter_class=_Help
    )
    ssub = store.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("ls", "every store: shards, objects, keys, bytes (JSON)"),
        ("clear", "drop every page of a store (its shards stay)"),
        ("drop", "kill a store's shards; every object they own is freed"),
    ):
        p = _command(ssub, action, text, "store")
        if action == "ls":
            p.add_argument("--json", metavar="PATH", help="also write the JSON here")
        else:
            p.add_argument("name", help="the store's name (RayStorageOptions.name)")
        _cluster_flags(p, "shard")
    _bench_parsers(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hicache-ray")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, check (a bad value is argparse's one-line error, exit 2, before anything
    starts), then run the command."""
    from hicache_ray.base.errors import ConfigError

    args = _parser().parse_args(argv)
    import apps.cli_commands as commands

    prepared: Any = None
    if args.prepare:
        check: Callable[[argparse.Namespace], Any] = getattr(commands, args.prepare)
        try:
            prepared = check(args)
        except (ConfigError, ValueError) as exc:
            args.parser.error(str(exc))
    run: Callable[[argparse.Namespace, Any], int] = getattr(commands, args.run)
    return run(args, prepared)


if __name__ == "__main__":
    sys.exit(main())
