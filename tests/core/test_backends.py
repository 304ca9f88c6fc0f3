"""Storage backends named by module path: built-in names, a path as the backend, refusals."""

from __future__ import annotations

import pytest

from hicache_ray.base.backends import backend_names, is_backend_path, register_backend
from hicache_ray.base.errors import ConfigError
from hicache_ray.base.storage_config import StorageConfig
from hicache_ray.keys import ShardPlan
from hicache_ray.storage import NullBackend, StorageBackend, create_backend
from tests.storage.conftest import make_plan


class _Marked(NullBackend):
    name = "marked"


def make_marked(config: StorageConfig, plan: ShardPlan) -> StorageBackend:
    return _Marked()


def not_a_backend(config: StorageConfig, plan: ShardPlan) -> object:
    return object()


def test_the_built_in_names_include_the_ray_store_without_importing_it() -> None:
    assert {"none", "memory", "file", "ray"} <= set(backend_names())


def test_a_path_is_a_backend_on_every_rank_without_registering() -> None:
    config = StorageConfig(backend=f"{__name__}:make_marked", model_id="m")
    assert isinstance(create_backend(config, make_plan()), _Marked)


def test_a_registered_path_is_a_name() -> None:
    register_backend("marked-test", f"{__name__}:make_marked")
    config = StorageConfig(backend="marked-test", model_id="m")
    assert isinstance(create_backend(config, make_plan()), _Marked)


@pytest.mark.parametrize(
    ("backend", "needle"),
    [
        ("nosuch", "no backend is registered"),
        ("nosuch.module:factory", "does not load"),
        (f"{__name__}:missing", "does not load"),
        (f"{__name__}:not_a_backend", "no StorageBackend"),
    ],
)
def test_a_backend_that_cannot_be_made_is_a_config_error(backend: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        config = StorageConfig(backend=backend, model_id="m")
        create_backend(config, make_plan())


@pytest.mark.parametrize(
    ("name", "factory"), [("", "m:f"), ("a:b", "m:f"), ("ok", "no-colon"), ("ok", "m:1x")]
)
def test_bad_registrations_are_refused(name: str, factory: str) -> None:
    with pytest.raises(ConfigError):
        register_backend(name, factory)


def test_paths_are_told_from_names() -> None:
    assert is_backend_path("a.b:c") and not is_backend_path("file") and not is_backend_path(":c")
