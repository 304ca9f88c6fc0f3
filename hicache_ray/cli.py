"""The ``hicache-ray`` command line (the composition root)."""

from __future__ import annotations

import os

# After each torch op, idle OpenMP threads spin for a while and starve the copy threads
# (L2 -> L1 loads ran ~25 % slower right after a copy_ here). libgomp reads this when
# torch loads, so it is set before any import below brings torch in.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import sys
from collections.abc import Sequence

import torch

from hicache_ray.bench.report import Figure, Report, machine_info
from hicache_ray.cli_experiments import (
    _DEMO_HELP,
    add_experiment_flags,
    add_serve_bench_flags,
    run_experiment,
    run_serve_bench_cli,
)
from hicache_ray.memory import default_device

__all__ = ["main"]


def _log(message: str) -> None:
    print(message, flush=True)


def _device(name: str) -> torch.device:
    return default_device() if name == "auto" else torch.device(name)


def _bench_micro(args: argparse.Namespace) -> int:
    from hicache_ray.bench.micro import MicroOptions, run_micro

    opts = MicroOptions.quick_options() if args.quick else MicroOptions()
    device = _device(args.device)
    torch.set_num_threads(args.threads)
    figures = run_micro(opts, device, _log)
    config = {**dataclasses.asdict(opts), "device": str(device), "threads": args.threads}
    return _finish(args, "bench micro", config, figures)


def _bench_storage(args: argparse.Namespace) -> int:
    from hicache_ray.bench.storage import StorageBenchOptions, run_storage_bench

    base = StorageBenchOptions.quick() if args.quick else StorageBenchOptions()
    backends = tuple(args.backend or base.backends)
    opts = dataclasses.replace(
        base, backends=tuple(b for b in backends if b != "sglang"), root=args.root or ""
    )
    torch.set_num_threads(args.threads)
    figures = run_storage_bench(opts, _log)
    config: dict[str, object] = dataclasses.asdict(opts)
    if "sglang" in backends:
        from hicache_ray.bench.sglang_storage import SGLangBenchOptions, run_sglang_bench

        sglang = SGLangBenchOptions.quick() if args.quick else SGLangBenchOptions()
        figures += run_sglang_bench(sglang, _log)
        config["sglang"] = dataclasses.asdict(sglang)
    return _finish(args, "bench storage", config, figures)


def _bench_runtime(args: argparse.Namespace) -> int:
    from hicache_ray.bench.runtime import RuntimeBenchOptions, run_runtime_bench

    opts = RuntimeBenchOptions.quick() if args.quick else RuntimeBenchOptions()
    torch.set_num_threads(args.threads)
    figures = run_runtime_bench(opts, _log)
    return _finish(args, "bench runtime", dataclasses.asdict(opts), figures)


def _stats(args: argparse.Namespace) -> int:
    import json

    import ray

    from actors.inspect import cluster_stats

    connected = ray.is_initialized()
    if not connected:
        ray.init(address=args.address, log_to_driver=False)
    try:
        found = cluster_stats(timeout_s=args.timeout)
    finally:
        if not connected:
            ray.shutdown()
    text = json.dumps(found, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text)
    print(text)
    unhealthy = [
        f"{dep} rank {r['rank']}"
        for dep, d in found["deployments"].items()
        for r in d["ranks"]
        if not r["health"].get("stepping")
    ]
    return 1 if unhealthy else 0


def _serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    import ray
    from ray import serve

    from actors.openai_app import build_app
    from actors.serve_config import SERVE_OPTIONS

    options = {k: str(v) for k in SERVE_OPTIONS if (v := getattr(args, k)) is not None}
    if args.served_name:
        options["served_name"] = args.served_name
    options["keep_store"] = str(args.keep_store)
    app = build_app(options)  # a bad option fails here, before anything starts
    started = not ray.is_initialized()
    if started:
        if args.address:
            ray.init(address=args.address, log_to_driver=False)
        else:
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="hicache-openai", route_prefix="/")
        _log(f"serving {options['model']} on http://{args.host}:{args.port}/v1 (Ctrl-C stops)")
        stop.wait()
        _log("shutting down")
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        if started:
            ray.shutdown()
    return 0


def _store(args: argparse.Namespace) -> int:
    import json

    import msgspec
    import ray

    from actors.stores import clear_store, drop_store, list_stores
    from hicache_ray.config import RayStorageOptions

    connected = ray.is_initialized()
    if not connected:
        ray.init(address=args.address, log_to_driver=False)
    try:
        found = {s.name: s for s in list_stores(timeout_s=args.timeout)}
        if args.action == "ls":
            text = json.dumps([msgspec.to_builtins(s) for s in found.values()], indent=2)
            if args.json:
                with open(args.json, "w") as out:
                    out.write(text)
            print(text)
            return 0
        if args.name not in found:
            print(f"hicache-ray store: no store named {args.name!r}", file=sys.stderr)
            return 1
        if args.action == "clear":
            clear_store(RayStorageOptions(name=args.name, num_shards=found[args.name].shards))
            print(f"cleared store {args.name!r}")
        else:
            shards = drop_store(args.name, timeout_s=args.timeout)
            print(f"dropped store {args.name!r} ({shards} shards)")
        return 0
    finally:
        if not connected:
            ray.shutdown()


def _bench_faults(args: argparse.Namespace) -> int:
    from actors.faults_bench import SCENARIOS, FaultOptions, run_faults

    scenarios = tuple(args.scenarios.split(",")) if args.scenarios else SCENARIOS
    opts = FaultOptions(scenarios=scenarios, tp_size=args.tp, model=args.model)
    figures = run_faults(opts, _log)
    status = _finish(args, "bench faults", dataclasses.asdict(opts), figures)
    return status or (1 if any(f.meets is False for f in figures) else 0)


def _bench_soak(args: argparse.Namespace) -> int:
    from actors.soak import SoakOptions, run_soak

    opts = SoakOptions(
        duration_s=args.duration,
        clients=args.clients,
        fault_every_s=args.fault_every,
        seed=args.seed,
    )
    figures = run_soak(opts, _log)
    status = _finish(args, "bench soak", dataclasses.asdict(opts), figures)
    return status or (1 if any(f.meets is False for f in figures) else 0)


def _finish(
    args: argparse.Namespace, command: str, config: dict[str, object], figures: list[Figure]
) -> int:
    report = Report(command=command, machine=machine_info(), config=config, figures=figures)
    _log(report.table())
    if args.json:
        report.write(args.json)
        _log(f"wrote {args.json}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache-ray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", metavar="PATH", help="write the report (schema in README)")
        p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
        p.add_argument("--threads", type=int, default=2, help="torch CPU threads")

    demo = sub.add_parser("demo", help=_DEMO_HELP)
    add_experiment_flags(demo, demo=True)
    demo.set_defaults(func=lambda a: run_experiment(a, True, _finish, _log))

    stats = sub.add_parser("stats", help="JSON: every deployment's ranks and L3 store in a cluster")
    stats.add_argument("--address", default="auto", help="Ray address of the cluster")
    stats.add_argument("--json", metavar="PATH", help="also write the JSON here")
    stats.add_argument("--timeout", type=float, default=10.0, help="seconds per actor")
    stats.set_defaults(func=_stats)

    from actors.serve_config import SERVE_OPTIONS

    serve_cmd = sub.add_parser(
        "serve", help="an OpenAI-compatible server (Ray Serve) for a checkpoint or a preset"
    )
    for name, (default, text) in SERVE_OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        serve_cmd.add_argument(
            flag,
            dest=name,
            default=None,
            required=name == "model",
            help=f"{text} (default: {default})" if default else text,
        )
    serve_cmd.add_argument("--served-name", default="", help="model name clients use")
    serve_cmd.add_argument("--keep-store", action="store_true", help="keep the L3 store at exit")
    serve_cmd.add_argument("--host", default="127.0.0.1", help="HTTP address to bind")
    serve_cmd.add_argument("--port", type=int, default=8000, help="HTTP port")
    serve_cmd.add_argument("--address", default="", help="Ray cluster (default: a local Ray)")
    serve_cmd.set_defaults(func=_serve)

    store = sub.add_parser("store", help="list, clear or drop the ray L3 stores of a cluster")
    store_sub = store.add_subparsers(dest="action", required=True)
    for action, text in (
        ("ls", "every store: shards, objects, keys, bytes (JSON)"),
        ("clear", "drop every page of a store (its shards stay)"),
        ("drop", "kill a store's shards; every object they own is freed"),
    ):
        p = store_sub.add_parser(action, help=text)
        if action != "ls":
            p.add_argument("name", help="the store's name (RayStorageOptions.name)")
        else:
            p.add_argument("--json", metavar="PATH", help="also write the JSON here")
        p.add_argument("--address", default="auto", help="Ray address of the cluster")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds per shard")
        p.set_defaults(func=_store)

    bench = sub.add_parser("bench", help="benchmarks that print figures beside ceilings")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    micro = bench_sub.add_parser("micro", help="L1<->L2 bandwidth per layout; tree throughput")
    common(micro)
    micro.add_argument("--quick", action="store_true", help="small shapes, for smoke tests")
    micro.set_defaults(func=_bench_micro)
    storage = bench_sub.add_parser("storage", help="page hashing; L3 put/get/exists throughput")
    common(storage)
    storage.add_argument(
        "--backend",
        action="append",
        choices=["memory", "file", "ray", "sglang"],
        help="repeatable; default memory and file (ray and sglang start a local Ray if none "
        "runs; sglang: the SGLang backend on the ray store, needs sglang installed)",
    )
    storage.add_argument("--root", help="file backend root (directory or URI); default a temp dir")
    storage.add_argument("--quick", action="store_true", help="small pages, for smoke tests")
    storage.set_defaults(func=_bench_storage)
    mt = bench_sub.add_parser("multiturn", help="multi-turn chat per cache mode vs an LRU oracle")
    add_experiment_flags(mt, demo=False)
    mt.set_defaults(func=lambda a: run_experiment(a, False, _finish, _log))
    serve = bench_sub.add_parser(
        "serve", help="clients under load per cache mode: throughput, TTFT, ITL, batching, overload"
    )
    add_serve_bench_flags(serve)
    serve.set_defaults(func=lambda a: run_serve_bench_cli(a, _finish, _log))
    faults = bench_sub.add_parser("faults", help="fault scenarios: wrong/failed requests, recovery")
    faults.add_argument("--json", metavar="PATH", help="write the report (schema in README)")
    faults.add_argument("--scenarios", help="comma-separated subset (default: all)")
    faults.add_argument("--tp", type=int, default=2, help="TP size of the deployments")
    faults.add_argument("--model", default="tiny4", help="reference model preset")
    faults.set_defaults(func=_bench_faults)
    soak = bench_sub.add_parser("soak", help="clients, small pools, all tiers, faults; bounded")
    soak.add_argument("--json", metavar="PATH", help="write the report (schema in README)")
    soak.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    soak.add_argument("--clients", type=int, default=6, help="concurrent conversations")
    soak.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults")
    soak.add_argument("--seed", type=int, default=0)
    soak.set_defaults(func=_bench_soak)
    rt = bench_sub.add_parser("runtime", help="TTFT per prefix tier vs recompute; miss overhead")
    common(rt)
    rt.add_argument("--quick", action="store_true", help="the tiny model, for smoke tests")
    rt.set_defaults(func=_bench_runtime)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
