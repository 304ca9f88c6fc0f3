"""Hugging Face checkpoints: a model directory's config, its revision, and one rank's shard.

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` directories with ``config.json`` and safetensors weights (one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``). Each rank reads
only its tensors, and of those only its rows or columns, through memory-mapped safetensors
slices: no rank materialises the whole model. Anything else (another architecture, a
missing or mis-shaped tensor, an unsupported RoPE type) is a ``ConfigError`` naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hicache_ray.base.errors import ConfigError
from hicache_ray.engine.model.config import ModelConfig, RopeScaling
from hicache_ray.engine.model.weights import LAYER_SPLITS, ModelWeights, split_ranges

__all__ = ["is_checkpoint", "load_config", "load_shard", "resolve_model"]

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# Our layer tensor names -> Hugging Face's, under ``model.layers.{i}.``.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "o": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
_SAMPLES = 16  # chunks of each weights file hashed into the revision
_SAMPLE_BYTES = 64 << 10


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a directory with a ``config.json``."""
    return os.path.isfile(os.path.join(path, "config.json"))


def resolve_model(spec: str, dtype: str | None = None) -> ModelConfig:
    """A preset name or a checkpoint directory, as a :class:`ModelConfig`."""
    from hicache_ray.engine.model.config import PRESETS, preset

    if spec in PRESETS:
        return preset(spec) if dtype is None else preset(spec, dtype=dtype)
    if is_checkpoint(spec):
        return load_config(spec, dtype)
    raise ConfigError(
        "model",
        spec,
        "neither a preset nor a model directory with a config.json",
        f"use one of {sorted(PRESETS)} or the path of a Hugging Face checkpoint",
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("checkpoint", str(path), f"unreadable: {exc}", "fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError("checkpoint", str(path), "not a JSON object", "fix the file")
    return data


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``rope_theta`` and scaling from either ``rope_scaling`` or ``rope_parameters``."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ConfigError(
            "rope_scaling", kind, "this RoPE type is not supported", "use default, linear, llama3"
        )
    fields = {k: v for k, v in params.items() if k in RopeScaling.__struct_fields__}
    fields = {
        k: float(v) if k != "original_max_position_embeddings" else int(v)
        for k, v in fields.items()
    }
    try:
        return theta, RopeScaling(type=kind, **fields)
    except TypeError as exc:
        raise ConfigError("rope_scaling", params, str(exc), "use the checkpoint's values") from None


def _eos(path: Path, hf: dict[str, Any]) -> tuple[int, ...]:
    found: list[int] = []
    sources = [hf]
    if (path / "generation_config.json").is_file():
        sources.append(_read_json(path / "generation_config.json"))
    for source in sources:
        eos = source.get("eos_token_id")
        for token in eos if isinstance(eos, list) else [eos]:
            if isinstance(token, int) and token not in found:
                found.append(token)
    return tuple(found)


def load_config(path: str, dtype: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint directory ``path`` (``dtype`` overrides
    the checkpoint's own).

    Raises:
        ConfigError: not a supported checkpoint (the message names what is not).
    """
    root = Path(path)
    hf = _read_json(root / "config.json")
    archs = hf.get("architectures") or []
    arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            "architecture",
            archs,
            "not supported",
            f"use a checkpoint of {', '.join(sorted(_ARCHITECTURES))}",
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError("hidden_act", hf["hidden_act"], "not supported", "only silu (SwiGLU)")
    wanted = dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if wanted not in _DTYPES:
        raise ConfigError("dtype", wanted, "not supported", f"use one of {sorted(_DTYPES)}")
    theta, scaling = _rope(hf)
    heads = int(hf["num_attention_heads"])
    window = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "mistral") else None
    try:
        return ModelConfig(
            name=root.resolve().name,
            architecture=arch,  # type: ignore[arg-type]
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            intermediate_size=int(hf["intermediate_size"]),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 0),
            sliding_window=int(window or 0),
            eos_token_ids=_eos(root, hf),
            dtype=_DTYPES[wanted],  # type: ignore[arg-type]
            checkpoint=str(root.resolve()),
            revision=checkpoint_revision(root),
        )
    except KeyError as exc:
        raise ConfigError(
            "config.json", str(root), f"lacks {exc}", "use a complete checkpoint"
        ) from None


def _weight_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        return {name: root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if not single.is_file():
        raise ConfigError(
            "checkpoint",
            str(root),
            "has no model.safetensors(.index.json)",
            "save it with safe_serialization (safetensors)",
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - not a dict


def checkpoint_revision(root: Path) -> str:
    """16 hex characters naming the checkpoint's weights: SHA-256 of ``config.json``, each
    weights file's size and header, and evenly spaced chunks of its bytes (reading every
    byte of a large checkpoint would cost minutes; a fine-tune changes every chunk)."""
    h = hashlib.sha256((root / "config.json").read_bytes())
    for path in sorted(set(_weight_files(root).values())):
        size = path.stat().st_size
        h.update(path.name.encode() + size.to_bytes(8, "little"))
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, 1 << 24)))
            for i in range(_SAMPLES):
                f.seek(size * i // _SAMPLES)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]


class _Reader:
    """Slices of tensors from memory-mapped safetensors files (each file opened once)."""

    def __init__(self, root: Path) -> None:
        from safetensors import safe_open

        self._files = _weight_files(root)
        self._open = safe_open
        self._handles: dict[Path, Any] = {}

    def read(
        self,
        name: str,
        shape: tuple[int, ...],
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Tensor ``name`` (checked to be ``shape``), or only its ``rows`` / ``cols``."""
        path = self._files.get(name)
        if path is None:
            raise ConfigError("checkpoint", name, "missing tensor", "use a complete checkpoint")
        if path not in self._handles:
            self._handles[path] = self._open(str(path), framework="pt").__enter__()  # type: ignore[no-untyped-call]
        part = self._handles[path].get_slice(name)
        got = tuple(part.get_shape())
        if got != shape:
            raise ConfigError(
                "checkpoint",
                name,
                f"has shape {list(got)}, expected {list(shape)}",
                "the checkpoint does not match its config.json",
            )
        if rows is not None:
            return part[rows[0] : rows[1]]  # type: ignore[no-any-return]
        if cols is not None:
            return part[:, cols[0] : cols[1]]  # type: ignore[no-any-return]
        return part[:]  # type: ignore[no-any-return]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def _layer_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, d = config.hidden_size, config.head_dim
    q, kv, ff = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (h,),
        "q": (q, h),
        "k": (kv, h),
        "v": (kv, h),
        "o": (h, q),
        "mlp_norm": (h,),
        "gate": (ff, h),
        "up": (ff, h),
        "down": (h, ff),
    }
    if config.qkv_bias:
        shapes |= {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,)}
    if config.qk_norm:
        shapes |= {"q_norm": (d,), "k_norm": (d,)}
    yield from shapes.items()


def load_shard(
    config: ModelConfig,
    tp_rank: int,
    tp_size: int,
    layer_range: tuple[int, int],
    device: torch.device,
    *,
    first_stage: bool,
    last_stage: bool,
) -> ModelWeights:
    """This rank's weights from ``config.checkpoint``, in ``config.dtype`` on ``device``."""
    reader = _Reader(Path(config.checkpoint))
    ranges = split_ranges(config, tp_rank, tp_size)
    dtype = getattr(torch, config.dtype)

    def place(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    try:
        layers = []
        for i in range(*layer_range):
            layer = {}
            for name, shape in _layer_shapes(config):
                kind = LAYER_SPLITS[name]
                span = ranges[kind] if kind is not None else None
                columns = kind in ("o", "down")
                t = reader.read(
                    f"model.layers.{i}.{_LAYER_NAMES[name]}",
                    shape,
                    rows=None if columns else span,
                    cols=span if columns else None,
                )
                layer[name] = place(t)
            layers.append(layer)
        v, h = config.vocab_size, config.hidden_size
        need_embed = first_stage or (last_stage and config.tie_embeddings)
        embed = place(reader.read("model.embed_tokens.weight", (v, h))) if need_embed else None
        norm = place(reader.read("model.norm.weight", (h,))) if last_stage else None
        lm_head = None
        if last_stage:
            lm_head = (
                embed if config.tie_embeddings else place(reader.read("lm_head.weight", (v, h)))
            )
        return ModelWeights(embed, layers, norm, lm_head)
    finally:
        reader.close()
