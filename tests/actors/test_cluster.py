"""Three simulated nodes (``ray.cluster_utils.Cluster``, fake GPUs): placement as planned,
a TP group on one node, L3 pages written on one node and read on another."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hicache_ray.base.storage_config import RayStorageOptions, StorageConfig
from hicache_ray.engine.request import GenerateRequest
from tests.actors.helpers import MODEL, cache_config, prompt, recompute, store_name
from tests.helpers import wait_until
from tests.storage.conftest import empty_buffers, make_pages, make_plan, page_keys

ray = pytest.importorskip("ray")
actors = pytest.importorskip("actors")
cluster_utils = pytest.importorskip("ray.cluster_utils")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    if ray.is_initialized():
        ray.shutdown()  # this module runs its own cluster; later modules start theirs again
    made = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    try:
        for i in (1, 2):
            made.add_node(num_cpus=2, num_gpus=2, resources={f"node{i}": 1})
        made.add_node(num_cpus=1, resources={"node3": 1, "l3_owner": 1})  # removed by a test
        made.wait_for_nodes()
        ray.init(address=made.address, log_to_driver=False)
        yield made
    finally:
        ray.shutdown()
        made.shutdown()


def _node_of(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def test_stages_land_one_tp_group_per_gpu_node(cluster: Any) -> None:
    store = store_name()
    config = actors.DeploymentConfig(
        name="c-tp2pp2",
        model=MODEL,
        tp_size=2,
        pp_size=2,
        gpus_per_rank=1,
        cache=cache_config(store),
        host_budget_bytes=16 << 20,
    )
    deployment = actors.Deployment.launch(config)
    try:
        nodes = ray.get([r.node_id.remote() for r in deployment.ranks])
        gpu_nodes = {_node_of("node1"), _node_of("node2")}
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3]  # each TP group on one node
        assert nodes[0] != nodes[2] and set(nodes) == gpu_nodes  # the stages on both nodes
        tokens = prompt(40, 30)
        result = deployment.generate([GenerateRequest("c1", tokens, 6)])[0]
        assert result.output_tokens == recompute(tokens, 6)
    finally:
        deployment.shutdown()
        actors.drop_store(store)


@ray.remote(num_cpus=0)
class _Client:
    """Writes or reads pages through the `ray` backend from the node it runs on."""

    def __init__(self, options: RayStorageOptions) -> None:
        from hicache_ray.storage import create_backend

        self.plan = make_plan()
        self.backend = create_backend(
            StorageConfig(backend="ray", model_id="test/model", ray=options), self.plan
        )

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def put(self, n: int) -> int:
        stored = self.backend.put(page_keys(self.plan, n), make_pages(self.plan, n))
        self.backend.flush()  # the shards own them now: they outlive this writer
        return stored

    def read_back(self, n: int) -> bool:
        out = empty_buffers(self.plan, n)
        if self.backend.get(page_keys(self.plan, n), out) != n:
            return False
        return all(bool((a == b).all()) for a, b in zip(out, make_pages(self.plan, n), strict=True))


def test_pages_written_on_one_node_are_read_on_another(cluster: Any) -> None:
    options = RayStorageOptions(name=store_name(), num_shards=2)
    writer = _Client.options(resources={"node1": 0.01}).remote(options)
    reader = _Client.options(resources={"node2": 0.01}).remote(options)
    try:
        assert ray.get(writer.node.remote()) != ray.get(reader.node.remote())
        assert ray.get(writer.put.remote(12)) == 12
        ray.kill(writer)  # the pages belong to the shards, not to the writer
        assert ray.get(reader.read_back.remote(12))
        # Wherever the shards (and so the objects) live, one of the two reads crossed nodes.
        other = _Client.options(resources={"node1": 0.01}).remote(options)
        assert ray.get(other.read_back.remote(12))
    finally:
        actors.drop_store(options.name)


def test_a_removed_node_makes_its_pages_misses_and_the_store_recovers(cluster: Any) -> None:
    # node3 alone offers "l3_owner" now: the shards, and the objects they own, live there
    options = RayStorageOptions(
        name=store_name(), num_shards=2, timeout_s=10, shard_resources={"l3_owner": 0.01}
    )
    writer = _Client.options(resources={"node1": 0.01}).remote(options)
    reader = _Client.options(resources={"node2": 0.01}).remote(options)
    try:
        assert ray.get(writer.put.remote(12)) == 12
        node3 = next(n for n in cluster.worker_nodes if n.node_id == _node_of("node3"))
        for i in range(2):
            shard = ray.get_actor(f"hicache-l3-{options.name}-{i}", namespace="hicache")
            assert ray.get(shard.node_id.remote()) == node3.node_id
        assert ray.get(reader.read_back.remote(12))
        cluster.add_node(num_cpus=1, resources={"l3_owner": 1})  # where the shards go next
        cluster.remove_node(node3)
        assert not ray.get(reader.read_back.remote(12))  # misses, never an error
        wait_until(lambda: ray.get(reader.put.remote(12)) == 12, timeout_s=120, what="recovery")
        assert ray.get(reader.read_back.remote(12))
    finally:
        actors.drop_store(options.name)
