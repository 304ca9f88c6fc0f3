"""Storage backends by name, each a ``"module:attribute"`` path imported on first use.

A name resolves in every process that reads a config (a rank actor as well as the driver),
so nothing has to be imported for its side effects: the ``ray`` backend lives in the Ray
layer and this library only names its path. ``StorageConfig.backend`` may also be a path
itself (``"my_pkg.l3:make_backend"``), which then works on every rank without registering.
A factory takes ``(StorageConfig, ShardPlan)`` and returns a ``StorageBackend``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from hicache_ray.errors import ConfigError

__all__ = [
    "backend_names",
    "check_backend_name",
    "is_backend_path",
    "load_factory",
    "register_backend",
]

_REGISTRY: dict[str, str | Callable[..., Any]] = {
    "none": "hicache_ray.storage.registry:null_backend",
    "memory": "hicache_ray.storage.registry:memory_backend",
    "file": "hicache_ray.storage.registry:file_backend",
    "ray": "actors.ray_store:ray_backend",
}


def register_backend(name: str, factory: str | Callable[..., Any]) -> None:
    """Make ``name`` usable as ``StorageConfig.backend``; a second registration replaces.

    ``factory`` is a ``"module:attribute"`` path (resolved in each process on first use) or a
    callable (known in this process only: rank actors run in other processes, so register a
    path, or name the path in the config, for backends that ranks create).
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ConfigError("backend name", name, "not a plain name", "use e.g. 'mystore'")
    if isinstance(factory, str) and not is_backend_path(factory):
        raise ConfigError("backend factory", factory, "not a path", "use 'module:attribute'")
    _REGISTRY[name] = factory


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def is_backend_path(name: str) -> bool:
    """Whether ``name`` is a ``"module:attribute"`` path rather than a registered name."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr.isidentifier())


def check_backend_name(name: str) -> None:
    """Raise ``ConfigError`` unless ``name`` is registered or a path."""
    if name not in _REGISTRY and not is_backend_path(name):
        raise ConfigError(
            "storage_backend",
            name,
            "no backend is registered under this name",
            f"use one of {', '.join(backend_names())}, a 'module:attribute' path, "
            "or register_backend() yours first",
        )


def load_factory(name: str) -> Callable[..., Any]:
    """The factory of backend ``name`` (a registered name or a path), imported if needed.

    Raises:
        ConfigError: the name is not registered, or its path does not import.
    """
    check_backend_name(name)
    entry = _REGISTRY.get(name, name)
    if not isinstance(entry, str):
        return entry
    module, _, attr = entry.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            "storage_backend", name, f"{entry} does not load ({e})", "install the module"
        ) from None
    if not callable(factory):
        raise ConfigError("storage_backend", name, f"{entry} is not callable", "name a factory")
    return factory  # type: ignore[no-any-return]
