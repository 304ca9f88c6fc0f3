"""Storage backends by name, each a ``"module:attribute"`` path imported on first use.

A name resolves in every process that reads a config (a rank actor as well as the driver),
so nothing has to be imported for its side effects. The library's own backends (``none``,
``memory``, ``file``) are named here; any other installed package names its backends as
entry points of the group ``hicache_ray.storage_backends`` (hicache-ray's Ray layer names
``ray`` so, in pyproject.toml): this library names nothing above it.
``StorageConfig.backend`` may also be a path itself (``"my_pkg.l3:make_backend"``), which
then works on every rank without registering.
A factory takes ``(StorageConfig, ShardPlan)`` and returns a ``StorageBackend``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from hicache_ray.base.errors import ConfigError

__all__ = [
    "ENTRY_POINT_GROUP",
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
}
ENTRY_POINT_GROUP = "hicache_ray.storage_backends"


def _entry(name: str) -> str | Callable[..., Any] | None:
    """A registered backend, else one an installed package names as an entry point."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    found = entry_points(group=ENTRY_POINT_GROUP, name=name)
    return next(iter(found)).value if found else None


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
    """Registered names and those installed packages name as entry points."""
    return sorted(set(_REGISTRY) | set(entry_points(group=ENTRY_POINT_GROUP).names))


def is_backend_path(name: str) -> bool:
    """Whether ``name`` is a ``"module:attribute"`` path rather than a registered name."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr.isidentifier())


def check_backend_name(name: str) -> None:
    """Raise ``ConfigError`` unless ``name`` is registered or a path."""
    if _entry(name) is None and not is_backend_path(name):
        raise ConfigError(
            "storage_backend",
            name,
            "no backend is registered under this name",
            f"use one of {', '.join(backend_names())}, a 'module:attribute' path, "
            "or register_backend() yours first (the 'ray' backend is named by the "
            "installed hicache-ray package: pip install it)",
        )


def load_factory(name: str) -> Callable[..., Any]:
    """The factory of backend ``name`` (a registered name or a path), imported if needed.

    Raises:
        ConfigError: the name is not registered, or its path does not import.
    """
    check_backend_name(name)
    entry = _entry(name) or name
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
