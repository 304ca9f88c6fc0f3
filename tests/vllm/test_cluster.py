"""vLLM replicas as a cache cluster on Ray Serve LLM: two ``HiCacheLLMServer`` replicas
(vLLM's CPU build, the connector on one file store) publish their own KV events to the
application's index, and the cache router sends each next turn to the replica that holds
its history; the connector's saves become the application's L3 pages; greedy answers of 50 calls
equal a plain vLLM engine's; a killed replica is forgotten and its replacement learned, and
the call it was answering is sent again to the other."""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from apps.bench.vllm_apps import vllm_env
from hicache_ray.base.errors import ConfigError
from hicache_ray.keys import page_hashes
from tests.helpers import wait_until
from tests.vllm.helpers import CONNECTOR, PAGE, file_store, prompt_ids

ray = pytest.importorskip("ray")
llm_api = pytest.importorskip("ray.serve.llm")

APP = "vllm-cluster-test"


MAX_LEN = 512  # the checkpoint's positions
LONG = MAX_LEN - 4 * PAGE  # tokens of the answer a replica is killed in the middle of


def _config(checkpoint: Path, root: Path, **engine: Any) -> Any:
    kwargs = {
        "dtype": "float32", "block_size": PAGE, "max_model_len": MAX_LEN, "enforce_eager": True,
        "kv_transfer_config": {**CONNECTOR, "kv_connector_extra_config": file_store(root)},
        **engine,
    }  # fmt: skip
    return llm_api.LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": str(checkpoint)},
        placement_group_config={"bundles": [{"CPU": 1}]},
        engine_kwargs=kwargs,
        deployment_config={"num_replicas": 2},
        runtime_env={"env_vars": vllm_env()},  # AsyncLLM: its engine core apart
    )


def test_bad_cluster_configs_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    from actors.vllm_serve import vllm_cluster_config

    good = _config(checkpoint, tmp_path)
    with pytest.raises(ConfigError, match="unknown router"):
        vllm_cluster_config(good, APP, router="random")
    with pytest.raises(ConfigError, match="block_size"):
        vllm_cluster_config(_config(checkpoint, tmp_path, block_size=None), APP)
    with pytest.raises(ConfigError, match="kv_events_config"):
        vllm_cluster_config(_config(checkpoint, tmp_path, kv_events_config={}), APP)
    with pytest.raises(ConfigError, match="HiCacheRayConnector"):
        vllm_cluster_config(_config(checkpoint, tmp_path, kv_transfer_config=None), APP)
    routed = vllm_cluster_config(good, APP, router="cache", weights={"wait_s": 30.0})
    options = routed.deployment_config["request_router_config"]
    assert options["request_router_kwargs"]["page_size"] == PAGE
    assert routed.experimental_configs["hicache_index"] == APP


def test_replicas_join_the_cluster_they_run_in(ray_local: None) -> None:
    from actors.vllm_serve import _joining_this_cluster

    here = ray.get_runtime_context().gcs_address
    ray_store = {**CONNECTOR, "kv_connector_extra_config": {"store": "ray", "ray": {"name": "x"}}}
    joined = _joining_this_cluster({"kv_transfer_config": ray_store})
    extra = joined["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra == {"store": "ray", "ray": {"name": "x"}, "ray_address": here}
    assert ray_store["kv_connector_extra_config"] == {"store": "ray", "ray": {"name": "x"}}
    given = {**CONNECTOR, "kv_connector_extra_config": {"store": "ray", "ray_address": "auto"}}
    files = {**CONNECTOR, "kv_connector_extra_config": {"store": "file"}}
    for kwargs in ({"kv_transfer_config": given}, {"kv_transfer_config": files}, {}):
        assert _joining_this_cluster(kwargs) == {}  # theirs kept; no ray store; no connector


def test_the_prefix_router_reads_token_id_prompts_as_text(checkpoint: Path, tmp_path: Path) -> None:
    from actors.vllm_serve import VllmPrefixRouter, vllm_cluster_config

    normalize = VllmPrefixRouter._normalize_prompt_to_string
    router = VllmPrefixRouter.__new__(VllmPrefixRouter)  # the method reads no state
    assert normalize(router, [5, 17, 3]) == "5 17 3 "
    assert normalize(router, [5, 17]) and normalize(router, [5, 17, 3]).startswith("5 17 ")
    assert normalize(router, "hi") == "hi"  # text and messages as Ray reads them
    assert normalize(router, [{"role": "user", "content": "hi"}]) == "hi"
    routed = vllm_cluster_config(_config(checkpoint, tmp_path), APP, router="prefix")
    options = routed.deployment_config["request_router_config"]
    assert options["request_router_class"] == "actors.vllm_serve:VllmPrefixRouter"


def test_the_cluster_app_keeps_its_ingress(checkpoint: Path, tmp_path: Path) -> None:
    from actors.vllm_serve import cluster_app, vllm_cluster_config

    config = vllm_cluster_config(_config(checkpoint, tmp_path), APP)
    with pytest.raises(ConfigError, match="HiCacheIngress"):
        cluster_app([config], ingress_cls_config={"ingress_cls": "x:Y"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    from ray import serve

    from actors.vllm_serve import cluster_app, vllm_cluster_config
    from tests.helpers import ensure_local_ray

    ensure_local_ray()
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = _config(checkpoint, tmp_path_factory.mktemp("l3"))
    # a loaded 2-core machine may answer the router late: it waits rather than guess
    config = vllm_cluster_config(config, APP, router="cache", weights={"wait_s": 30.0})
    try:
        serve.run(cluster_app([config]), name=APP)
        yield port
    finally:
        serve.shutdown()


def _complete(port: int, prompt: list[int], max_tokens: int = 4) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=180) as response:
        answer = json.loads(response.read())
    return list(answer["choices"][0]["token_ids"])


def _holders(index: Any, turns: list[list[int]]) -> dict[int, list[str]]:
    """Conversation -> the replicas whose vLLM holds its whole prompt, in the index."""
    replicas = ray.get(index.replicas.remote())
    out = {}
    for c, prompt in enumerate(turns):
        hits = ray.get(index.hits.remote(replicas, page_hashes(prompt, PAGE)))
        out[c] = [r for r, h in hits.items() if h.device >= len(prompt) // PAGE]
    return out


def _in_l3(index: Any, pages: set[str]) -> bool:
    return pages <= set(ray.get(index.changes.remote("", 0)).store)


def _all_held(index: Any, turns: list[list[int]]) -> bool:
    return all(_holders(index, turns).values())


def test_next_turns_reach_the_replica_that_holds_their_history(
    ray_local: None, cluster: int, checkpoint: Path
) -> None:
    from tests.vllm.helpers import plain_engine

    turns = [[(7 * c + i) % 200 + 3 for i in range(3 * PAGE)] for c in range(4)]
    answers = {c: _complete(cluster, p) for c, p in enumerate(turns)}
    index = _index_now()  # the router made it for the first call
    assert index is not None
    wait_until(partial(_all_held, index, turns), 60, "the first turns in the index")
    assert len(ray.get(index.replicas.remote())) == 2
    first = {c: held[0] for c, held in _holders(index, turns).items()}
    for c, prompt in enumerate(turns):
        turns[c] = prompt + answers[c] + [(c + 11) % 200 + 3] * (PAGE - 4)
        answers[c] = _complete(cluster, turns[c])
    wait_until(partial(_all_held, index, turns), 60, "the second turns in the index")
    holders = _holders(index, turns)
    # each history is on the replica that held its first turn, and on that one only
    assert holders == {c: [r] for c, r in first.items()}, (first, holders)
    # the connector's saves reach the index as the application's L3 pages
    firsts = {h for p in turns for h in page_hashes(p[: 3 * PAGE], PAGE)}
    wait_until(partial(_in_l3, index, firsts), 60, "the first turns' pages in the L3 index")
    # 42 more calls (8 shared system prompts, some served again): 50 in all against plain vLLM
    sample = [(turns[c], answers[c]) for c in range(len(turns))]
    systems = [prompt_ids(60 + s, 2 * PAGE) for s in range(8)]
    for i in range(42):
        prompt = systems[i % 8] + prompt_ids(100 + i % 21, 5 + i % 7 * PAGE // 4)
        sample.append((prompt, _complete(cluster, prompt)))
    with plain_engine(checkpoint) as plain:  # no connector, no cache shared
        wrong = [i for i, (prompt, answer) in enumerate(sample) if answer != plain(prompt, 4)]
    assert not wrong, f"{len(wrong)} of {len(sample)} answers differ from plain vLLM: {wrong}"


def _replica_actor(replica: str) -> Any:
    """The Serve replica actor of the cluster's engine replica ``replica``."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if name.startswith(f"SERVE_REPLICA::{APP}#HiCacheLLMServer") and name.endswith(replica):
            return ray.get_actor(name, namespace=actor["namespace"])
    raise LookupError(replica)


def _index_now() -> Any:
    """The application's index (the router's process made it), or None."""
    from actors.index_actor import find_index

    return find_index(APP)


def _replicas_now(index: Any) -> list[str]:
    return list(ray.get(index.replicas.remote(), timeout=30))


def test_a_killed_replica_is_forgotten_and_its_replacement_learned(
    ray_local: None, cluster: int
) -> None:
    turns = [[(11 * c + i) % 200 + 3 for i in range(3 * PAGE)] for c in range(2)]
    for prompt in turns:
        _complete(cluster, prompt)
    index = _index_now()
    wait_until(partial(_all_held, index, turns), 60, "the turns in the index")
    # A call with a long answer (turn 0's next): the replica serving it is killed once the
    # call's prompt is in its cache (LONG tokens still to go), and the call is sent again.
    long = turns[0] + [7] * PAGE
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(_complete, cluster, long, LONG)
        wait_until(lambda: bool(_holders(index, [long])[0]), 60, "the long call's prompt held")
        lost = _holders(index, [long])[0][0]
        ray.kill(_replica_actor(lost), no_restart=True)
        answer = call.result(timeout=300)
    assert len(answer) == LONG
    # the index is the router's, not a replica's: the kill took nothing of it but the replica
    wait_until(lambda: lost not in _replicas_now(index), 90, "the killed replica forgotten")
    now = _index_now()
    assert now is not None and now._actor_id == index._actor_id
    for c, prompt in enumerate(turns):  # every call after the kill is answered
        turns[c] = prompt + [(c + 5) % 200 + 3] * PAGE
        assert len(_complete(cluster, turns[c])) == 4
    wait_until(partial(_all_held, index, turns), 60, "the next turns in the index")
    assert all(lost not in holders for holders in _holders(index, turns).values())
    # the long call was answered by the survivor: its prompt is in that replica's cache
    assert _holders(index, [long])[0] not in ([], [lost])

    def replaced() -> bool:  # Serve starts a replacement, whose events reach the index
        replicas = _replicas_now(index)
        return len(replicas) == 2 and lost not in replicas

    wait_until(replaced, 300, "the replacement replica in the index")
