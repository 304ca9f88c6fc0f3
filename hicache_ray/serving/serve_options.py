"""The deployment behind ``hicache-ray serve`` and ``serve run actors.openai_app:build_app``,
from their string options (checked here: a bad value is a ``ConfigError`` naming it)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, NamedTuple

from hicache_ray.base.config import CacheConfig, MemoryConfig, SchedulerConfig
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import FileStorageOptions, RayStorageOptions, StorageConfig
from hicache_ray.serving.pd_split import MAX_PREFILL_REPLICAS

if TYPE_CHECKING:  # the spec imports the model (torch); the CLI's --help imports this module
    from hicache_ray.engine.spec import DeploymentConfig
    from hicache_ray.serving.tenants import KeySpec

__all__ = [
    "ROUTERS",
    "PDServe",
    "ROUTE_WEIGHTS",
    "SERVE_OPTIONS",
    "serve_deployment_config",
    "serve_ingresses",
    "serve_keys",
    "serve_pd",
    "serve_replicas",
    "vllm_serve_spec",
]

# ``hicache-ray serve`` and ``serve run actors.openai_app:build_app``: option -> (default,
# help); values arrive as strings and are checked by ``serve_deployment_config``.
SERVE_OPTIONS: dict[str, tuple[str, str]] = {
    "model": ("", "a preset (tiny, tiny4, bench: random weights) or a checkpoint directory"),
    "engine": (
        "hicache",
        "hicache (this library's engine) or vllm (vLLM replicas on Ray Serve LLM sharing the "
        "L3 through the connector; run from vLLM's environment: docs/vllm.md)",
    ),
    "dtype": (
        "auto",
        "vllm engine only: the dtype vLLM computes in (auto, float32, bfloat16, float16); on "
        "CPU the connector takes vLLM's vec attention kernels only: float32, or bfloat16 on "
        "a CPU without AMX",
    ),
    "eager": (
        "false",
        "vllm engine only: true runs vLLM eagerly (its enforce_eager: no torch.compile, no "
        "CUDA graphs): a replica answers its first call in seconds rather than after a "
        "compile of minutes, and each step runs slower on a GPU",
    ),
    "tp": ("1", "tensor-parallel size"),
    "pp": ("1", "pipeline-parallel size"),
    "storage": ("ray", "L3 backend: ray (the Ray object store), file, or none"),
    "storage_root": ("", "directory or URI of the file backend"),
    "store": ("", "name of the ray L3 store (default: serve-<model>)"),
    "storage_bytes": (
        "0",
        "L3 byte limit (least recently used pages go past it); 0: ray keeps half the "
        "cluster's object store, file has no limit (a warning says so)",
    ),
    "device_tokens": ("16384", "L1 (device pool) tokens per rank"),
    "host_ratio": ("2.0", "L2 (host pool) size as a multiple of L1"),
    "page_size": ("16", "tokens per KV page"),
    "max_queued": ("1024", "requests waiting to start before more are refused (503)"),
    "cpus_per_rank": ("1", "CPUs each rank reserves"),
    "gpus_per_rank": ("0", "GPUs each rank reserves (1 on GPU clusters)"),
    "replicas": ("1", "engine replicas, each with its own ranks, L1 and L2, over one L3 store"),
    "prefill_tp": (
        "0",
        "with decode_tp: prefill and decode as two deployments joined by L3, long uncached "
        "prompts prefilled apart (docs/serving.md); the prefill side's TP size (0: off)",
    ),
    "decode_tp": ("0", "the decode side's TP size (with prefill_tp; tp is then unused)"),
    "prefill_replicas": (
        "1",
        "with prefill_tp: deployments of the prefill side (1 to 64); each prompt prefilled "
        "apart goes to the one that would finish it first",
    ),
    "pd_min_uncached": (
        "2048",
        "with prefill_tp: prefill apart only prompts with at least this many tokens the "
        "decode side does not hold",
    ),
    "router": (
        "cache",
        "how the ingress picks a replica (replicas > 1): cache (what their caches hold), "
        "prefix (Ray's PrefixCacheAffinityRouter) or pow2 (power of two choices)",
    ),
    "ingresses": (
        "1",
        "HTTP ingress replicas in front of the engine replicas (replicas > 1); each routes "
        "with its own router instance, as several gateways would",
    ),
    "api_keys": (
        "",
        "a keys file: one 'KEY TENANT [quota=BYTES]' per line; calls need "
        "'Authorization: Bearer KEY' (401 without); read again when it changes",
    ),
    "api_key_sha256": (
        "",
        "comma-separated SHA-256 hex digests of keys, each its own tenant (what --api-key "
        "passes; the keys themselves never leave the CLI)",
    ),
    "route_weights": (
        "",
        "the cache router's weights, e.g. l1=1,l2=0.8,l3=0.6,load=1,call=0,room=0.25,"
        "hold_s=0,wait_s=0.1 (share of a page's prefill an L1 / L2 / L3 hit saves, weight of "
        "a token of prefill pending on a replica, a request's cost beyond its prefill in "
        "tokens, what a cached token costs a new prefix, the longest a call waits for a "
        "sibling's pages, the index's answer time)",
    ),
}
ROUTERS = ("cache", "prefix", "pow2")
ROUTE_WEIGHTS = ("l1", "l2", "l3", "load", "call", "room", "hold_s", "wait_s")


def _number(name: str, value: str, kind: type[int] | type[float]) -> float:
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(
            name,
            value,
            f"not {'an integer' if kind is int else 'a number'}",
            f"give a {kind.__name__}",
        ) from None


def serve_deployment_config(args: dict[str, str]) -> DeploymentConfig:
    """The :class:`~hicache_ray.engine.spec.DeploymentConfig` of the serve options ``args``."""
    from hicache_ray.engine.model.checkpoint import resolve_model
    from hicache_ray.engine.spec import DeploymentConfig

    unknown = set(args) - set(SERVE_OPTIONS) - {"served_name", "keep_store"}
    if unknown:
        raise ConfigError(
            "serve", sorted(unknown), "unknown options", f"use {sorted(SERVE_OPTIONS)}"
        )
    opts = {k: args.get(k, default) for k, (default, _) in SERVE_OPTIONS.items()}
    if opts["engine"] != "hicache":
        raise ConfigError("engine", opts["engine"], "not this engine's", "use hicache here")
    for name in VLLM_ONLY:
        if opts[name] != SERVE_OPTIONS[name][0]:
            raise ConfigError(
                name, opts[name], "an option of the vllm engine only", "leave it out here"
            )
    if not opts["model"]:
        raise ConfigError("model", "", "missing", "give a preset name or a checkpoint directory")
    model = resolve_model(opts["model"])
    backend = opts["storage"]
    if backend not in ("ray", "file", "none"):
        raise ConfigError("storage", backend, "unknown backend", "use ray, file or none")
    store = opts["store"] or f"serve-{model.name}".replace(".", "-")
    limit = int(_number("storage_bytes", opts["storage_bytes"], int))
    storage = StorageConfig(
        backend=backend,
        model_id=model.name if not model.checkpoint else "",
        ray=RayStorageOptions(
            name="".join(c if c.isalnum() or c in "-_" else "-" for c in store),
            capacity_bytes=limit,
        ),
        file=FileStorageOptions(root=opts["storage_root"], capacity_bytes=limit),
    )
    cache = CacheConfig(
        memory=MemoryConfig(
            page_size=int(_number("page_size", opts["page_size"], int)),
            device_tokens=int(_number("device_tokens", opts["device_tokens"], int)),
            hicache_ratio=float(_number("host_ratio", opts["host_ratio"], float)),
        ),
        storage=storage,
    )
    return DeploymentConfig(
        name=f"openai-{os.getpid()}",
        model=model,
        tp_size=int(_number("tp", opts["tp"], int)),
        pp_size=int(_number("pp", opts["pp"], int)),
        cache=cache,
        scheduler=SchedulerConfig(max_queued=int(_number("max_queued", opts["max_queued"], int))),
        cpus_per_rank=float(_number("cpus_per_rank", opts["cpus_per_rank"], float)),
        gpus_per_rank=int(_number("gpus_per_rank", opts["gpus_per_rank"], int)),
    )


def serve_keys(args: dict[str, str]) -> KeySpec:
    """The API keys of the serve options ``args`` (the keys file is read once here, so a
    bad one stops the start)."""
    from hicache_ray.serving.tenants import ApiKeys, KeySpec

    digests = tuple(d.strip().lower() for d in args.get("api_key_sha256", "").split(",") if d)
    for d in digests:
        if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
            raise ConfigError("api_key_sha256", d, "not a SHA-256 hex digest", "give 64 hex digits")
    path = args.get("api_keys", "")
    if path:
        path = os.path.abspath(path)
        ApiKeys((), path)  # raises ConfigError naming the line
    return KeySpec(digests, path)


def serve_ingresses(args: dict[str, str]) -> int:
    """The number of HTTP ingress replicas of the serve options ``args``."""
    ingresses = int(_number("ingresses", args.get("ingresses", "1"), int))
    if not 1 <= ingresses <= 64:
        raise ConfigError("ingresses", ingresses, "out of range", "give 1 to 64 ingresses")
    return ingresses


def serve_replicas(args: dict[str, str]) -> tuple[int, str, dict[str, float]]:
    """The number of engine replicas, the router and its weights of the serve options
    ``args``."""
    replicas = int(_number("replicas", args.get("replicas", "1"), int))
    if not 1 <= replicas <= 64:
        raise ConfigError("replicas", replicas, "out of range", "give 1 to 64 replicas")
    router = args.get("router", "cache")
    if router not in ROUTERS:
        raise ConfigError("router", router, "unknown router", f"use one of {', '.join(ROUTERS)}")
    weights: dict[str, float] = {}
    for item in filter(None, args.get("route_weights", "").split(",")):
        name, _, value = item.partition("=")
        if name.strip() not in ROUTE_WEIGHTS:
            raise ConfigError(
                "route_weights", item, "unknown weight", f"use {', '.join(ROUTE_WEIGHTS)}"
            )
        number = _number(f"route_weights.{name.strip()}", value.strip(), float)
        if number < 0:
            raise ConfigError("route_weights", item, "negative", "give a number >= 0")
        weights[name.strip()] = number
    return replicas, router, weights


class PDServe(NamedTuple):
    """A prefill/decode pair's serve options: its TP sizes, split threshold and prefill
    replicas."""

    prefill_tp: int
    decode_tp: int
    min_uncached_tokens: int
    prefill_replicas: int = 1


def serve_pd(args: dict[str, str]) -> PDServe | None:
    """The prefill/decode pair of the serve options ``args``; None: one deployment.

    Raises:
        ConfigError: one size without the other, a size out of range, no L3, or with more
            than one replica or the vLLM engine (a pair is one replica for now).
    """
    sizes = [int(_number(k, args.get(k, "0"), int)) for k in ("prefill_tp", "decode_tp")]
    replicas = int(_number("prefill_replicas", args.get("prefill_replicas", "1"), int))
    if sizes == [0, 0]:
        if replicas != 1:
            raise ConfigError(
                "prefill_replicas", replicas, "without a pair", "give --prefill-tp and --decode-tp"
            )
        return None
    if not 1 <= replicas <= MAX_PREFILL_REPLICAS:
        raise ConfigError(
            "prefill_replicas", replicas, "out of range", f"give 1 to {MAX_PREFILL_REPLICAS}"
        )
    for name, size in zip(("prefill_tp", "decode_tp"), sizes, strict=True):
        if not 1 <= size <= 64:
            raise ConfigError(name, size, "out of range", "give both sizes, 1 to 64 (or neither)")
    if args.get("storage", "ray") == "none":
        raise ConfigError(
            "storage", "none", "prefill hands pages to decode in L3", "use ray or file"
        )
    if args.get("replicas", "1") != "1" or args.get("engine", "hicache") != "hicache":
        raise ConfigError(
            "prefill_tp", sizes[0], "a pair serves as one hicache replica", "drop --replicas"
        )
    least = int(_number("pd_min_uncached", args.get("pd_min_uncached", "2048"), int))
    if not 0 <= least <= 1 << 30:
        raise ConfigError("pd_min_uncached", least, "out of range", "give 0 to 2**30 tokens")
    return PDServe(sizes[0], sizes[1], least, replicas)


# The serve options a vLLM cluster takes (the rest configure this library's engine).
VLLM_OPTIONS = ("model", "engine", "dtype", "eager", "tp", "storage", "storage_root", "store",
                "storage_bytes", "page_size", "cpus_per_rank", "gpus_per_rank", "replicas",
                "router", "route_weights", "served_name", "keep_store")  # fmt: skip
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
VLLM_ONLY = ("dtype", "eager")  # refused by this library's engine


def vllm_serve_spec(args: dict[str, str]) -> dict[str, Any]:
    """What ``hicache-ray serve --engine vllm`` runs, from the serve options ``args``: the
    model directory and served name, vLLM's engine arguments (the connector's included),
    the replicas, their router and its weights, and each replica's placement bundles.

    Raises:
        ConfigError: an option of this library's engine only, a preset or missing model,
            no L3 (the replicas share pages through it), a bad number.
    """
    foreign = sorted(k for k in args if k not in VLLM_OPTIONS)
    if foreign:
        raise ConfigError(
            "serve", foreign, "options of the hicache engine only", f"use {list(VLLM_OPTIONS)}"
        )
    model = args.get("model", "")
    if not os.path.isdir(model):
        raise ConfigError("model", model, "not a checkpoint directory", "give vLLM's model dir")
    backend = args.get("storage", "ray")
    if backend not in ("ray", "file"):
        raise ConfigError("storage", backend, "the replicas share pages in L3", "use ray or file")
    compute = _vllm_compute(args)
    name = args.get("served_name") or os.path.basename(os.path.normpath(model))
    limit = int(_number("storage_bytes", args.get("storage_bytes", "0"), int))
    tp = int(_number("tp", args.get("tp", "1"), int))
    connector: dict[str, Any] = {"store": backend, "model_id": name}
    if backend == "ray":
        store = args.get("store") or f"serve-{name}"
        clean = "".join(c if c.isalnum() or c in "-_" else "-" for c in store)
        connector["ray"] = {"name": clean, "capacity_bytes": limit}
    else:
        connector["file"] = {"root": args.get("storage_root", ""), "capacity_bytes": limit}
    engine = {
        **compute,
        "block_size": int(_number("page_size", args.get("page_size", "16"), int)),
        "tensor_parallel_size": tp,
        "enable_prompt_tokens_details": True,  # usage's cached_tokens, as our engine has
        "kv_transfer_config": {
            "kv_connector": "HiCacheRayConnector",
            "kv_connector_module_path": "hicache_ray.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": connector,
        },
    }
    replicas, router, weights = serve_replicas(args)
    bundle = {
        "CPU": _number("cpus_per_rank", args.get("cpus_per_rank", "1"), float),
        "GPU": _number("gpus_per_rank", args.get("gpus_per_rank", "0"), int),
    }
    return {
        "model": model,
        "served_name": name,
        "engine_kwargs": engine,
        "replicas": replicas,
        "router": router,
        "weights": weights,
        "bundles": [{k: v for k, v in bundle.items() if v}] * tp,
    }


def _vllm_compute(args: dict[str, str]) -> dict[str, Any]:
    """vLLM's ``dtype`` and ``enforce_eager`` from the serve options ``dtype`` and ``eager``."""
    dtype = args.get("dtype", SERVE_OPTIONS["dtype"][0])
    if dtype not in VLLM_DTYPES:
        raise ConfigError("dtype", dtype, "not a dtype vLLM computes in", f"use {VLLM_DTYPES}")
    eager = args.get("eager", SERVE_OPTIONS["eager"][0])
    if eager not in ("true", "false"):
        raise ConfigError("eager", eager, "not a boolean", "use true or false")
    return {"dtype": dtype, "enforce_eager": eager == "true"}
