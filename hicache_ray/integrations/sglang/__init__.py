"""hicache-ray's L3 as an SGLang HiCache storage backend (``backend``, imports SGLang) and
its SGLang-free parts (options, host pool layouts).

May import ``base``, ``keys``, ``storage`` and ``cache``; never the engine. ``module_path``
is this package: ``HiCacheRayStorage`` is loaded from ``backend`` on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["HiCacheRayStorage"]


def __getattr__(name: str) -> Any:
    if name != "HiCacheRayStorage":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.backend").HiCacheRayStorage
