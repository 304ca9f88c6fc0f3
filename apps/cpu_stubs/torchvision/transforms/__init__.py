"""Stand-in ``torchvision.transforms`` (see the package docstring)."""

from __future__ import annotations

from typing import Any

from torchvision import _Unavailable
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable
