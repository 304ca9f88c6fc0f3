"""vLLM engines for ``bench trace --engine vllm``: the cluster of :mod:`actors.vllm_serve` (vLLM
replicas on Ray Serve LLM, the cache router, the connector on one ray store) in each mode,
and a plain vLLM engine (no connector, no prefix cache) that the answers are checked
against. Runs where vLLM and ``ray[serve,llm]`` are installed (``make setup-vllm``).

The modes, as vLLM has them: ``none`` (no prefix cache), ``l1_l2`` (each replica's own
prefix cache, no L3: vLLM has no host tier of its own here) and ``l1_l2_l3`` (the prefix
cache and the connector on the shared ray store). Every replica's KV cache holds the same
number of blocks as this library's L1 in the same run (``num_gpu_blocks_override``).
"""

from __future__ import annotations

import atexit
import functools
import getpass
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from apps.bench.shm_orphans import remove_orphans, shm_names
from hicache_ray.base.errors import ConfigError

__all__ = [
    "REPLICA_ENV",
    "VLLM_PAGE",
    "check_vllm_model",
    "vllm_app",
    "vllm_env",
    "vllm_max_len",
    "vllm_recompute",
    "vllm_scratch_env",
]

VLLM_PAGE = 32  # vLLM's CPU kernels take block sizes in multiples of 32
# Each replica's process: vLLM's engine core apart (AsyncLLM), threads not pinned to cores.
REPLICA_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment of the vLLM processes a bench starts: ``REPLICA_ENV``, the scratch
    folder's variables (:func:`vllm_scratch_env`) and ``extra``."""
    return {**REPLICA_ENV, **vllm_scratch_env(), **extra}


def vllm_scratch_env() -> dict[str, str]:
    """Variables that point vLLM's temporary files at a folder of this process's own,
    removed when it exits.

    vLLM names its engines' ZMQ sockets (``VLLM_RPC_BASE_PATH``) and its rendezvous files
    (``vllm_dist_*``, the temporary folder) there and leaves them when an engine is killed,
    as Serve kills a replica's: bench and test runs left them in ``/tmp``. Ray's files
    (``RAY_TMPDIR``) and torch's compile cache (``TORCHINDUCTOR_CACHE_DIR``) stay where
    they were, so runs keep sharing the cache."""
    folder, ray_dir, inductor = _scratch()
    return {
        "TMPDIR": folder,
        "VLLM_RPC_BASE_PATH": folder,
        "RAY_TMPDIR": ray_dir,
        "TORCHINDUCTOR_CACHE_DIR": inductor,
    }


@functools.cache
def _scratch() -> tuple[str, str, str]:
    """This process's folder for vLLM's temporary files (removed at exit), Ray's temporary
    folder, and torch's compile cache (as set, or their defaults)."""
    system = tempfile.gettempdir()
    inductor = Path(system) / f"torchinductor_{getpass.getuser()}"
    folder = tempfile.mkdtemp(prefix="hicache-vllm-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    atexit.register(remove_orphans, shm_names())  # what killed engines leave in /dev/shm
    env = os.environ
    return folder, env.get("RAY_TMPDIR", system), env.get("TORCHINDUCTOR_CACHE_DIR", str(inductor))


def check_vllm_model(model: str, page_size: int) -> None:
    """``--engine vllm`` runs a Hugging Face checkpoint directory, in blocks vLLM's CPU
    kernels take."""
    if not Path(model, "config.json").is_file():
        raise ConfigError(
            "--model", model, "vLLM runs a checkpoint directory", "give one (docs/vllm.md)"
        )
    if page_size % VLLM_PAGE:
        raise ConfigError(
            "page size", page_size, f"vLLM's CPU blocks are multiples of {VLLM_PAGE}", "use 32"
        )


def vllm_max_len(model: str, device_tokens: int, page_size: int) -> int:
    """The longest request a replica of ``model`` admits: the model's, within its KV cache
    of ``device_tokens`` (vLLM keeps one block of it aside, and refuses to start with a
    longer ``max_model_len`` than the rest holds)."""
    from hicache_ray.engine.model.checkpoint import resolve_model

    room = max(page_size, device_tokens - page_size)
    longest = resolve_model(model).max_context
    return min(longest, room) if longest else room


def _engine_kwargs(spec: dict[str, Any], mode: str, blocks: int, max_len: int) -> dict[str, Any]:
    """``hicache-ray serve --engine vllm``'s engine arguments (``spec``: the connector on
    its ray store; none below ``l1_l2_l3``), and the bench's: this run's KV cache size and
    request length, the prefix cache off in ``none``."""
    engine: dict[str, Any] = dict(spec["engine_kwargs"])
    if mode != "l1_l2_l3":
        del engine["kv_transfer_config"]
    engine.update(
        enforce_eager=True,
        enable_prefix_caching=mode != "none",
        num_gpu_blocks_override=blocks,
        **({"max_model_len": max_len} if max_len else {}),
    )
    return engine


def vllm_app(
    model: str,
    served: str,
    mode: str,
    *,
    replicas: int,
    router: str,
    page_size: int,
    device_tokens: int,
    max_len: int,
    store: str,
    index: str = "",
    ingresses: int = 1,
    weights: str = "",
) -> Any:
    """The Serve app of ``replicas`` vLLM replicas of ``model`` (served as ``served``) in
    ``mode``, behind ``router`` (the cache router with ``weights``, as serve's
    ``--route-weights``) and ``ingresses`` OpenAI ingresses; their KV caches hold
    ``device_tokens`` each; ``index``: the application's index (its name)."""
    from ray.serve.llm import LLMConfig

    from actors.vllm_serve import cluster_app, vllm_cluster_config
    from hicache_ray.serving.serve_options import vllm_serve_spec

    args = {"model": model, "dtype": "float32", "page_size": str(page_size), "store": store}
    spec = vllm_serve_spec({**args, **({"route_weights": weights} if weights else {})})
    blocks = max(1, device_tokens // page_size)
    config = LLMConfig(
        model_loading_config={"model_id": served, "model_source": model},
        placement_group_config={"bundles": [{"CPU": 1}]},
        engine_kwargs=_engine_kwargs(spec, mode, blocks, max_len),
        deployment_config={"num_replicas": replicas, "ray_actor_options": {"num_cpus": 0}},
        runtime_env={"env_vars": vllm_env()},
    )
    app = index or f"trace-vllm-{os.getpid()}-{mode.replace('_', '-')}"
    shared = mode == "l1_l2_l3"
    cluster = vllm_cluster_config(config, app, router, spec["weights"], shared=shared)
    return cluster_app([cluster], ingress_deployment_config={"num_replicas": ingresses})


def vllm_recompute(
    model: str, prompts: list[list[int]], max_tokens: list[int], max_len: int
) -> list[list[int]]:
    """Greedy answers of a plain vLLM engine of ``model`` (no connector, no prefix cache) to
    ``prompts``, ``max_tokens`` each, end-of-sequence ignored: in a Ray task of its own,
    so that the engine goes with its process."""
    import ray

    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    options: dict[str, Any] = {"num_cpus": 1, "max_retries": 0, "max_calls": 1}  # then it exits
    task = ray.remote(**options, runtime_env={"env_vars": env})(_recompute)
    answers: list[list[int]] = ray.get(task.remote(model, prompts, max_tokens, max_len))
    return answers


def _recompute(
    model: str, prompts: list[list[int]], max_tokens: list[int], max_len: int
) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        block_size=VLLM_PAGE,
        seed=0,
        **({"max_model_len": max_len} if max_len else {}),
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]
