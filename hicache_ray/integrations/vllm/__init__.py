"""hicache-ray's L3 inside vLLM: the KV connector (``connector``, imports vLLM) and its
Ray- and vLLM-free parts (options, page plans, block tables, metrics).

May import ``base``, ``keys``, ``storage`` and ``engine.model``'s configuration; never the
engine's runtime. ``kv_connector_module_path`` is this package: ``HiCacheRayConnector`` is
loaded from ``connector`` on first use, so its pure modules import without vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["HiCacheRayConnector"]


def __getattr__(name: str) -> Any:
    if name != "HiCacheRayConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.connector").HiCacheRayConnector
