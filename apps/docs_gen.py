"""The generated parts of docs/: the configuration reference (from the config structs'
docstrings, defaults and types) and the metrics table (from ``hicache_ray.base.metrics``).

    python -m apps.docs_gen           # rewrite them in docs/
    python -m apps.docs_gen --check   # exit 1 when docs/ is stale (a test runs it)

Each generated block sits between ``<!-- generated ... -->`` and ``<!-- end generated -->``
in its file; the text around it is written by hand.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import msgspec

__all__ = ["config_reference", "field_docs", "regenerate"]

DOCS = Path(__file__).resolve().parents[1] / "docs"
_BLOCK = re.compile(r"(<!-- generated [^>]*-->\n)(.*?)(<!-- end generated -->)", re.S)


def field_docs(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of ``cls``'s docstring (a line
    ``a, b: text`` documents both)."""
    doc = inspect.getdoc(cls) or ""
    if "Attributes:" not in doc:
        return {}
    out: dict[str, str] = {}
    names: list[str] = []
    for line in doc.split("Attributes:", 1)[1].splitlines():
        if not line.strip():
            continue
        head = re.match(r"    ([A-Za-z_][\w, /]*?):\s(.*)", line)
        if head and not line.startswith("     "):
            names = [n.strip() for n in re.split(r"[,/]", head[1]) if n.strip()]
            for name in names:
                out[name] = head[2].strip()
        elif line.startswith("        ") and names:
            for name in names:
                out[name] += " " + line.strip()
        elif not line.startswith(" "):
            break
    return out


def _default(field: Any) -> str:
    value = field.default
    if value is msgspec.NODEFAULT:
        if field.default_factory is msgspec.NODEFAULT:
            return "(required)"
        value = field.default_factory()
    if isinstance(value, msgspec.Struct):
        return f"`{type(value).__name__}()`"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1 << 20:
        return f"`{int(value)}`"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20:
        return f"`{value}` ({value / 2**20:g} MiB)" if value % (1 << 20) == 0 else f"`{value}`"
    return f"`{value!r}`".replace("'", '"')


def _type(field: Any) -> str:
    if get_origin(field.type) is Literal:
        return " \\| ".join(f'"{v}"' for v in get_args(field.type))
    text = getattr(field.type, "__name__", None) or str(field.type)
    text = text.replace("typing.", "").replace("hicache_ray.base.config.", "")
    return re.sub(r"<class '([\w.]+)'>", lambda m: m[1].rsplit(".", 1)[-1], text)


def config_reference(classes: list[type], prefixes: dict[type, str]) -> str:
    """One table per struct: field, type, default, meaning.

    Raises:
        ValueError: a field has no text in its struct's docstring (docs would drift).
    """
    parts = []
    for cls in classes:
        docs = field_docs(cls)
        missing = [f.name for f in msgspec.structs.fields(cls) if f.name not in docs]
        if missing and cls.__name__ != "CacheConfig":
            raise ValueError(f"{cls.__name__}: no docstring text for {missing}")
        summary = (inspect.getdoc(cls) or "").split("\n\n", 1)[0].replace("\n", " ")
        parts.append(f"### `{prefixes.get(cls, '')}{cls.__name__}`\n\n{summary}\n")
        rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
        for field in msgspec.structs.fields(cls):
            text = docs.get(field.name, f"see `{_type(field)}` below").replace("|", "\\|")
            kind = _type(field)
            kind = kind if kind.startswith('"') else f"`{kind}`"
            rows.append(f"| `{field.name}` | {kind} | {_default(field)} | {text} |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def _configuration() -> str:
    from hicache_ray.base import config as c
    from hicache_ray.base import storage_config as sc
    from hicache_ray.engine.model.config import ModelConfig
    from hicache_ray.engine.spec import DeploymentConfig
    from hicache_ray.integrations.sglang.setup import SGLangStoreOptions
    from hicache_ray.integrations.vllm.setup import VLLMStoreOptions
    from hicache_ray.serving.pd_config import PDConfig
    from hicache_ray.serving.pd_split import SplitPolicy

    classes: list[type] = [
        c.CacheConfig,
        c.MemoryConfig,
        c.WriteConfig,
        c.PrefetchConfig,
        sc.StorageConfig,
        sc.MemoryStorageOptions,
        sc.FileStorageOptions,
        sc.RayStorageOptions,
        sc.Fault,
        c.SchedulerConfig,
        DeploymentConfig,
        ModelConfig,
        SGLangStoreOptions,
        VLLMStoreOptions,
        PDConfig,
        SplitPolicy,
    ]
    prefixes: dict[type, str] = {
        DeploymentConfig: "actors.",
        ModelConfig: "hicache_ray.engine.model.",
        SGLangStoreOptions: "",
        VLLMStoreOptions: "",
        PDConfig: "actors.pd.",
        SplitPolicy: "hicache_ray.serving.pd_split.",
    }
    return config_reference(classes, prefixes)


def _metrics() -> str:
    from hicache_ray.base.metrics import markdown_table

    return markdown_table()


_GENERATED = {"configuration.md": _configuration, "metrics.md": _metrics}


def regenerate(check: bool) -> list[str]:
    """Rewrite (or, with ``check``, compare) every generated block; the stale files."""
    stale = []
    for name, make in _GENERATED.items():
        path = DOCS / name
        text = path.read_text()
        found = _BLOCK.search(text)
        if found is None:
            raise ValueError(f"{path}: no <!-- generated --> block")
        new = text[: found.start(2)] + make() + text[found.end(2) :]
        if new != text:
            stale.append(str(path))
            if not check:
                path.write_text(new)
    return stale


if __name__ == "__main__":
    checking = "--check" in sys.argv[1:]
    changed = regenerate(checking)
    for path in changed:
        print(f"{'stale' if checking else 'rewrote'}: {path}")
    sys.exit(1 if checking and changed else 0)
