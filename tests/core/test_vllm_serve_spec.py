"""``hicache-ray serve --engine vllm``: the serve options become vLLM's engine arguments
(the connector on the shared L3 included), the replicas and their router; options of this
library's engine, presets and a cluster without L3 are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_ray.base.errors import ConfigError
from hicache_ray.serving.serve_options import serve_deployment_config, vllm_serve_spec


def test_the_options_become_a_cluster_spec(tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    args = {"model": str(model), "engine": "vllm", "tp": "2", "page_size": "32",
            "replicas": "3", "router": "prefix", "route_weights": "l3=0.5",
            "store": "my store", "storage_bytes": "1024", "gpus_per_rank": "1"}  # fmt: skip
    spec = vllm_serve_spec(args)
    assert spec["served_name"] == "tiny-llama" and spec["model"] == str(model)
    engine = spec["engine_kwargs"]
    assert engine["block_size"] == 32 and engine["tensor_parallel_size"] == 2
    assert engine["enable_prompt_tokens_details"] is True  # cached tokens in the usage
    assert engine["dtype"] == "auto" and engine["enforce_eager"] is False
    options = engine["kv_transfer_config"]["kv_connector_extra_config"]
    assert options == {"store": "ray", "model_id": "tiny-llama",
                       "ray": {"name": "my-store", "capacity_bytes": 1024}}  # fmt: skip
    assert (spec["replicas"], spec["router"], spec["weights"]) == (3, "prefix", {"l3": 0.5})
    assert spec["bundles"] == [{"CPU": 1.0, "GPU": 1}] * 2
    files = vllm_serve_spec({"model": str(model), "storage": "file", "storage_root": "/l3",
                             "served_name": "m", "dtype": "float32", "eager": "true"})  # fmt: skip
    assert files["engine_kwargs"]["dtype"] == "float32"
    assert files["engine_kwargs"]["enforce_eager"] is True
    connector = files["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert connector["file"]["root"] == "/l3" and connector["model_id"] == "m"


def test_what_a_vllm_cluster_cannot_take_is_refused(tmp_path: Path) -> None:
    model = str(tmp_path)
    for bad, match in [
        ({"model": model, "device_tokens": "512"}, "hicache engine only"),
        ({"model": model, "api_key_sha256": "ab"}, "hicache engine only"),
        ({"model": "tiny4"}, "checkpoint directory"),
        ({"model": model, "storage": "none"}, "share pages in L3"),
        ({"model": model, "tp": "two"}, "tp"),
        ({"model": model, "router": "random"}, "router"),
        ({"model": model, "dtype": "int8"}, "not a dtype vLLM computes in"),
        ({"model": model, "eager": "yes"}, "not a boolean"),
    ]:
        with pytest.raises(ConfigError, match=match):
            vllm_serve_spec(bad)
    with pytest.raises(ConfigError, match="engine"):
        serve_deployment_config({"model": "tiny", "engine": "vllm"})
    for vllm_only in ({"dtype": "float32"}, {"eager": "true"}):
        with pytest.raises(ConfigError, match="vllm engine only"):
            serve_deployment_config({"model": "tiny", **vllm_only})
