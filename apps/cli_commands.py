"""What each ``hicache-ray`` command does, and the checks that run before any starts.

``main`` calls ``prepare(args)`` (a ``ConfigError`` or ``ValueError`` there becomes
argparse's one-line error, exit 2, before Ray or a model is touched), then
``run(args, prepared)``. Heavy imports happen here, only for the command that runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from apps.cli_benches import (
    bench_faults,
    bench_pd,
    bench_route,
    bench_soak,
    bench_trace,
    finish,
)
from apps.cli_benches import log as _log
from apps.cli_experiments import experiment_options as options
from apps.cli_experiments import serve_options as serve_bench_options
from hicache_ray.base.errors import ConfigError

T = TypeVar("T")

__all__ = [
    "bench_faults",
    "bench_micro",
    "bench_pd",
    "bench_route",
    "bench_runtime",
    "bench_soak",
    "bench_storage",
    "bench_trace",
    "check_device",
    "experiment",
    "options",
    "serve",
    "serve_bench",
    "serve_app",
    "serve_bench_options",
    "stats",
    "store",
]


# ---------------------------------------------------------------- checks (before anything)


def check_device(args: argparse.Namespace) -> Any:
    """The torch device of ``--device``; CUDA asked for on a machine without it is refused."""
    import torch

    if args.device == "auto":
        from hicache_ray.cache.memory import default_device

        return default_device()
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                "--device", args.device, "CUDA is not available here", "use --device cpu or auto"
            )
        index = int(args.device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(
                "--device", args.device, f"only {torch.cuda.device_count()} GPUs", "pick one"
            )
    return torch.device(args.device)


def serve_app(args: argparse.Namespace) -> Any:
    """The Serve app of ``hicache-ray serve`` (every option checked, nothing started)."""
    from actors.openai_app import build_app
    from apps.cli_args import SERVE_OPTIONS

    given = {k: str(v) for k in SERVE_OPTIONS if (v := getattr(args, k)) is not None}
    keys = [*args.api_key, *filter(None, [os.environ.get("HICACHE_RAY_API_KEY", "")])]
    if keys:  # the keys stay here: the app is told their digests
        from hicache_ray.serving.tenants import key_digest

        digests = [key_digest(k) for k in keys] + [given.get("api_key_sha256", "")]
        given["api_key_sha256"] = ",".join(filter(None, digests))
    if args.served_name:
        given["served_name"] = args.served_name
    given["keep_store"] = str(args.keep_store)
    if given.get("engine") == "vllm":  # vLLM replicas on Ray Serve LLM (vLLM's environment)
        from actors.vllm_serve import build_vllm_app
        from hicache_ray.serving.serve_options import vllm_serve_spec

        vllm_serve_spec(given)  # checked now; built once Ray is up (Ray LLM joins a cluster)
        return given, functools.partial(build_vllm_app, given)
    return given, build_app(given)


# ---------------------------------------------------------------- benchmarks


def bench_micro(args: argparse.Namespace, device: Any) -> int:
    import torch

    from apps.bench.micro import MicroOptions, run_micro

    opts = MicroOptions.quick_options() if args.quick else MicroOptions()
    torch.set_num_threads(args.threads)
    figures = run_micro(opts, device, _log)
    config = {**dataclasses.asdict(opts), "device": str(device), "threads": args.threads}
    return finish(args, "bench micro", config, figures)


def bench_storage(args: argparse.Namespace, _: None) -> int:
    import torch

    from apps.bench.storage import StorageBenchOptions, run_storage_bench

    base = StorageBenchOptions.quick() if args.quick else StorageBenchOptions()
    backends = tuple(args.backend or base.backends)
    engines = ("sglang", "vllm")  # integrations, each with its own benchmark
    opts = dataclasses.replace(
        base, backends=tuple(b for b in backends if b not in engines), root=args.root or ""
    )
    torch.set_num_threads(args.threads)
    figures = run_storage_bench(opts, _log)
    config: dict[str, Any] = dataclasses.asdict(opts)
    if "sglang" in backends:
        from apps.bench.sglang_storage import SGLangBenchOptions, run_sglang_bench

        sglang = SGLangBenchOptions.quick() if args.quick else SGLangBenchOptions()
        figures += run_sglang_bench(sglang, _log)
        config["sglang"] = dataclasses.asdict(sglang)
    if "vllm" in backends:
        from apps.bench.vllm_storage import VLLMBenchOptions, run_vllm_bench

        vllm = VLLMBenchOptions.quick() if args.quick else VLLMBenchOptions()
        figures += run_vllm_bench(vllm, _log)
        config["vllm"] = dataclasses.asdict(vllm)
    return finish(args, "bench storage", config, figures)


def bench_runtime(args: argparse.Namespace, _: None) -> int:
    import torch

    from apps.bench.runtime import RuntimeBenchOptions, run_runtime_bench

    opts = RuntimeBenchOptions.quick() if args.quick else RuntimeBenchOptions()
    torch.set_num_threads(args.threads)
    if args.profile:
        figures = _profiled(args.profile, lambda: run_runtime_bench(opts, _log))
    else:
        figures = run_runtime_bench(opts, _log)
    return finish(args, "bench runtime", dataclasses.asdict(opts), figures)


def _profiled(path: str, run: Callable[[], T]) -> T:
    """``run()`` under cProfile: the stats written to ``path``, the top 25 printed."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    out = profiler.runcall(run)
    profiler.dump_stats(path)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    _log(f"wrote the profile to {path} (read it with: python -m pstats {path})")
    return out


def experiment(args: argparse.Namespace, opts: Any) -> int:
    """``demo`` and ``bench multiturn``: exit 1 when a sampled answer differs from recompute."""
    from apps.experiments import DEMO_SHAPES, run_demo, run_multiturn_bench
    from apps.multiturn.report import plot, rows

    demo = args.command == "demo"
    series, figures = (run_demo if demo else run_multiturn_bench)(opts, _log)
    config = dataclasses.asdict(opts)
    if demo:  # the shapes the demo really runs, not the (unused) bench options
        for key in ("tp_size", "pp_size", "modes"):
            config.pop(key)
        config["deployments"] = {
            name: {"tp_size": tp, "pp_size": 1} for name, tp in DEMO_SHAPES
        } | {f"{name}-nocache": {"tp_size": tp, "pp_size": 1} for name, tp in DEMO_SHAPES}
    command = "demo" if demo else "bench multiturn"
    status = finish(args, command, config, figures, rows(series))
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        title = "hicache-ray demo: TP=2 then TP=4" if demo else "hicache-ray bench multiturn"
        _log(f"wrote {png}" if plot(series, png, title) else "no matplotlib: no plot")
    wrong = next(f for f in figures if f.name == "multiturn.exactness.wrong_outputs")
    return status or (1 if wrong.value else 0)


def serve_bench(args: argparse.Namespace, opts: Any) -> int:
    from apps.bench.serve_bench import run_serve_bench
    from apps.bench.serve_plot import plot_serve

    figures = run_serve_bench(opts, _log)
    status = finish(args, "bench serve", dataclasses.asdict(opts), figures)
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        _log(f"wrote {png}" if plot_serve(figures, opts.modes, png) else "no matplotlib: no plot")
    return status


# ---------------------------------------------------------------- a running cluster


def stats(args: argparse.Namespace, _: None) -> int:
    from apps.cli_cluster import connected, run_in_cluster

    if args.address.kind == "dashboard":
        return run_in_cluster(args, ["stats", "--timeout", str(args.timeout)])
    from actors.inspect import cluster_stats

    with connected(args.address, args.timeout):
        found = cluster_stats(timeout_s=args.timeout)
    _emit(args, found)
    unhealthy = [
        f"{dep} rank {r['rank']}"
        for dep, d in found["deployments"].items()
        for r in d["ranks"]
        if not r["health"].get("stepping")
    ]
    return 1 if unhealthy else 0


def store(args: argparse.Namespace, _: None) -> int:
    import msgspec

    from apps.cli_cluster import connected, run_in_cluster

    if args.address.kind == "dashboard":
        rest = [] if args.action == "ls" else [args.name]
        return run_in_cluster(args, ["store", args.action, *rest, "--timeout", str(args.timeout)])
    from actors.stores import clear_store, drop_store, list_stores
    from hicache_ray.base.storage_config import RayStorageOptions

    with connected(args.address, args.timeout):
        found = {s.name: s for s in list_stores(timeout_s=args.timeout)}
        if args.action == "ls":
            _emit(args, [msgspec.to_builtins(s) for s in found.values()])
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


def _emit(args: argparse.Namespace, found: Any) -> None:
    text = json.dumps(found, indent=2, default=str)
    if getattr(args, "json", None):
        Path(args.json).write_text(text)
    print(text)


def _door_note(given: dict[str, str], host: str) -> str:
    """What the start-up says about who may call the server."""
    if given.get("api_key_sha256") or given.get("api_keys"):
        return "calls need an API key (Authorization: Bearer KEY); each tenant has its own cache"
    if host in ("127.0.0.1", "localhost", "::1"):
        return f"no API key: bound to {host} only (give --api-key to serve other machines)"
    return f"WARNING: no API key and bound to {host}: anyone who reaches it can call it"


def serve(args: argparse.Namespace, prepared: Any) -> int:
    import signal
    import threading

    import ray
    from ray import serve as ray_serve

    given, app = prepared
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
        ray_serve.start(http_options={"host": args.host, "port": args.port})
        if isinstance(app, functools.partial):
            app = app()
        ray_serve.run(app, name="hicache-openai", route_prefix="/")
        _log(f"serving {given['model']} on http://{args.host}:{args.port}/v1 (Ctrl-C stops)")
        _log(_door_note(given, args.host))
        if given.get("storage") == "file" and not int(given.get("storage_bytes", "0")):
            _log("WARNING: the file L3 has no byte limit: give --storage-bytes to bound it")
        stop.wait()
        _log("shutting down")
    finally:
        ray_serve.shutdown()  # type: ignore[no-untyped-call]
        if given.get("engine") == "vllm":
            from actors.vllm_serve import drop_cluster_store

            drop_cluster_store(given)
        if started:
            ray.shutdown()
    return 0
