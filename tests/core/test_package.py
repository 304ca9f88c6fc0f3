"""The package surface: lazy public names, and the CLI's process settings."""

from __future__ import annotations

import subprocess
import sys

import hicache_ray


def test_every_public_name_resolves() -> None:
    for name in hicache_ray.__all__:
        assert getattr(hicache_ray, name).__name__ == name


def test_unknown_name_raises_attribute_error() -> None:
    try:
        hicache_ray.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_cli_sets_passive_openmp_before_torch_loads() -> None:
    code = (
        "import os, sys; os.environ.pop('OMP_WAIT_POLICY', None)\n"
        "import hicache_ray\n"
        "assert 'torch' not in sys.modules, 'importing the package loaded torch'\n"
        "import apps.cli\n"
        "print(os.environ['OMP_WAIT_POLICY'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
