"""A stand-in for ``torchvision`` where SGLang runs on a CPU torch (tests, `bench micro`).

SGLang 0.5.23 imports torchvision at module level on the import path of its memory pools
(``sglang.srt.configs`` -> multimodal processors), and PyPI's torchvision wheels are CUDA
builds that fail to load beside the CPU torch (``operator torchvision::nms does not
exist``). Nothing the storage tests or the tree comparison run touches an image; any use
of this stand-in raises.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.0.0+hicache-ray-cpu-stub"


class _Unavailable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision is a stand-in (hicache-ray runs SGLang on a CPU torch)")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable
