"""A real vLLM engine (CPU, in process) with the hicache-ray connector, and the tiny
checkpoint both engines load (head_dim 32: vLLM's CPU attention needs 32 or more)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PAGE = 32  # vLLM's CPU kernels take block sizes in multiples of 32
MODEL_ID = "tiny-llama"
CONNECTOR = {
    "kv_connector": "HiCacheRayConnector",
    "kv_connector_module_path": "hicache_ray.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def file_store(root: Path, **extra: Any) -> dict[str, Any]:
    """The connector's options for a file store at ``root`` (TP 1 and 2 share it)."""
    return {"store": "file", "file": {"root": str(root)}, "model_id": MODEL_ID,
            "share_tp": [1, 2], **extra}  # fmt: skip


@contextmanager
def engine(checkpoint: Path, extra: dict[str, Any] | None, **options: Any) -> Iterator[Any]:
    """A vLLM ``LLM`` of ``checkpoint`` whose connector has ``extra`` (None: no connector),
    and ``options``, more of ``LLM``'s arguments; torn down after."""
    from vllm import LLM
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    llm = LLM(
        model=str(checkpoint),
        dtype="float32",
        enforce_eager=True,
        block_size=PAGE,
        max_model_len=512,
        seed=0,
        kv_transfer_config=None
        if extra is None
        else {**CONNECTOR, "kv_connector_extra_config": extra},
        **options,
    )
    try:
        yield llm
    finally:
        # Now, not at garbage collection: the worker's shutdown clears vLLM's process-wide
        # connector, which must not happen once the next engine has set its own.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()


@contextmanager
def plain_engine(checkpoint: Path) -> Iterator[Callable[[list[int], int], list[int]]]:
    """Greedy answers of a plain vLLM engine of ``checkpoint`` (no connector)."""
    with engine(checkpoint, None) as llm:
        yield lambda tokens, max_new: generate(llm, tokens, max_new, drain=False)[0]


def prompt_ids(seed: int, n: int) -> list[int]:
    """``n`` random token ids of the tiny checkpoint's vocabulary (no special tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def generate(
    llm: Any, tokens: list[int], max_new: int = 8, salt: str = "", drain: bool = True
) -> tuple[list[int], int]:
    """Greedy answer ids and vLLM's cached prompt tokens (its own and the connector's);
    waits until the pages the run stored are in the store (``drain``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=tokens)
    if salt:
        prompt["cache_salt"] = salt
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    if drain:
        worker().drain_saves()
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def worker() -> Any:
    """The worker side of the connector of the engine running in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def scheduler(llm: Any) -> Any:
    """The scheduler side of ``llm``'s connector (the engine runs in this process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def corrupt_page(root: Path, page_hash: str) -> None:
    """Flip a payload byte of a page's last object in a file store at ``root``."""
    path = sorted(root.glob(f"{page_hash[:2]}/{page_hash}_*"))[-1]  # its last head group
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x5A  # a payload byte: the checksum no longer matches
    path.write_bytes(bytes(data))
