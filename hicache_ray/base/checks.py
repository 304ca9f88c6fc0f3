"""Checks shared by every config struct: types first, then ranges, each a ``ConfigError``.

msgspec structs do not check types when built from Python (``MemoryConfig(page_size="16")``
is accepted as is), so every config's ``__post_init__`` starts with :func:`check_types`,
which converts each field strictly against its annotation (no ``2.0`` for an int, no
``True`` for a number, no ``None`` for a string), and rejects non-finite floats. The range
checks below are written so that NaN fails them too.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args, get_origin

import msgspec

from hicache_ray.base.errors import ConfigError

__all__ = [
    "check_choice",
    "check_custom_resources",
    "check_fraction",
    "check_not_negative",
    "check_positive",
    "check_types",
]


def _type_name(tp: Any) -> str:
    name = getattr(tp, "__name__", None)
    return name if isinstance(name, str) else str(tp).replace("typing.", "")


def check_types(obj: msgspec.Struct, prefix: str = "") -> None:
    """Raise :class:`ConfigError` for the first field of ``obj`` whose value does not have
    its annotated type (strictly), or is a non-finite float."""
    for field in msgspec.structs.fields(obj):
        value = getattr(obj, field.name)
        name = prefix + field.name
        if get_origin(field.type) is Literal:
            check_choice(name, value, field.type)
            continue
        try:
            msgspec.convert(value, field.type, strict=True)
        except msgspec.ValidationError as exc:
            raise ConfigError(
                name,
                value,
                f"wrong type ({exc})",
                f"give a {_type_name(field.type)}",
            ) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(name, value, "not a finite number", "give a finite number")


def check_positive(field: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(field, value, "must be positive", "set a value above 0")


def check_not_negative(field: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(field, value, "negative", "use 0 or more")


def check_fraction(field: str, value: float) -> None:
    """A value in (0, 1]."""
    if not 0 < value <= 1:
        raise ConfigError(field, value, "outside (0, 1]", "use e.g. 0.5")


def check_choice(field: str, value: object, literal: object) -> None:
    choices = get_args(literal)
    if type(value) is not str or value not in choices:
        raise ConfigError(field, value, "unknown name", f"use one of {', '.join(choices)}")


def check_custom_resources(field: str, resources: dict[str, float], fix: str) -> None:
    """Custom Ray resources: named (never ``CPU`` or ``GPU``), positive amounts."""
    for resource, amount in resources.items():
        if not resource or resource in ("CPU", "GPU"):
            raise ConfigError(field, resource, "not a custom resource", fix)
        check_positive(f"{field}[{resource!r}]", amount)
