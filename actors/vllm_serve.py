"""vLLM engine replicas as a cache cluster, on Ray Serve LLM.

Ray Serve LLM (``ray.serve.llm``: ``LLMServer`` replicas behind its OpenAI ingress) runs
vLLM's CPU build here, so the cluster plugs into it instead of wrapping vLLM anew:

* every replica is a :class:`HiCacheLLMServer` (Ray LLM's ``LLMServer``, ``server_cls``):
  its vLLM engine stores and loads pages through ``HiCacheRayConnector`` on the shared
  store (``engine_kwargs["kv_transfer_config"]``), and publishes its KV events on ZeroMQ
  sockets of its own (``kv_events_config``, set here per replica). A
  :class:`~hicache_ray.integrations.vllm.event_feed.VllmEventFeed` renames them by page
  hashes (:class:`~hicache_ray.integrations.vllm.events.VllmJournal`) and a
  :class:`~actors.index_actor.Publisher` sends them to the application's index, as an
  engine replica of this library does;
* the ``cache`` router is :class:`VllmCacheRouter`: the cache router of
  :mod:`actors.routing` (the same cost by tier and load), reading the prompt from Ray
  LLM's request (vLLM's ``CompletionRequest`` or ``ChatCompletionRequest``): token ids as
  sent, or the text tokenized as vLLM tokenizes it (the model's tokenizer and chat
  template); ``prefix`` is Ray's ``PrefixCacheAffinityRouter`` (:class:`VllmPrefixRouter`:
  taught token-id prompts); ``pow2`` Serve's default.

:func:`vllm_cluster_config` turns an ``LLMConfig`` into the cluster's; :func:`cluster_app`
builds the app with Ray LLM's ``build_openai_app`` and :class:`HiCacheIngress`, its OpenAI
ingress that sends a call again when its replica dies before answering. Runs where vLLM
and ``ray[serve,llm]`` are installed (``make setup-vllm``).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ray import serve
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.request_router import PendingRequest

from actors.index_actor import Publisher
from actors.resend import resent_stream
from actors.routing import CacheAwareRouter
from actors.stores import drop_store
from hicache_ray.base.errors import ConfigError
from hicache_ray.integrations.vllm.event_feed import VllmEventFeed
from hicache_ray.integrations.vllm.events import VllmJournal
from hicache_ray.serving.serve_options import vllm_serve_spec

__all__ = [
    "HiCacheIngress",
    "HiCacheLLMServer",
    "VllmCacheRouter",
    "build_vllm_app",
    "cluster_app",
    "drop_cluster_store",
    "named_answer",
    "vllm_cluster_config",
]

log = logging.getLogger(__name__)

INDEX_KEY = "hicache_index"  # experimental_configs: the application's index name
ROUTERS = ("cache", "prefix", "pow2")


def _connector_options(engine_kwargs: dict[str, Any], *, shared: bool = True) -> dict[str, Any]:
    """The connector's options (``shared``: it must be there; else {} without it)."""
    transfer = engine_kwargs.get("kv_transfer_config")
    if transfer is None and not shared:
        return {}
    if not isinstance(transfer, dict) or transfer.get("kv_connector") != "HiCacheRayConnector":
        raise ConfigError(
            "engine_kwargs.kv_transfer_config",
            transfer,
            "the replicas share pages through the connector",
            "set kv_connector HiCacheRayConnector, kv_connector_module_path "
            "hicache_ray.integrations.vllm (docs/vllm.md)",
        )
    options = transfer.get("kv_connector_extra_config", {})
    return options if isinstance(options, dict) else {}


def vllm_cluster_config(
    llm_config: Any,
    app: str,
    router: str = "cache",
    weights: dict[str, float] | None = None,
    *,
    shared: bool = True,
) -> Any:
    """``llm_config`` (Ray LLM's ``LLMConfig`` of a vLLM model whose ``engine_kwargs`` set
    ``block_size`` and the connector) as replicas of the cache cluster ``app``, routed
    by ``router``; ``weights``: the cache router's (:meth:`CacheAwareRouter.
    initialize_state`). ``shared`` False: replicas without the connector may be given
    (a baseline with no L3, each replica's own prefix cache only; ``bench trace``)."""
    if router not in ROUTERS:
        raise ConfigError("router", router, "unknown router", f"use one of {', '.join(ROUTERS)}")
    kwargs = dict(llm_config.engine_kwargs)
    page = kwargs.get("block_size")
    if type(page) is not int or page <= 0:
        raise ConfigError(
            "engine_kwargs.block_size", page, "it is the page size", "set it (an int > 0)"
        )
    if "kv_events_config" in kwargs:
        raise ConfigError(
            "engine_kwargs.kv_events_config",
            kwargs["kv_events_config"],
            "the cluster sets it per replica (its own ZeroMQ sockets)",
            "leave it out",
        )
    salt = str(_connector_options(kwargs, shared=shared).get("tenant_salt", ""))
    deployment = dict(llm_config.deployment_config)
    if router != "pow2":
        options: dict[str, Any] = {"request_router_class": "actors.vllm_serve:VllmPrefixRouter"}
        if router == "cache":
            tokenizer = llm_config.model_loading_config.model_source or llm_config.model_id
            options = {
                "request_router_class": "actors.vllm_serve:VllmCacheRouter",
                "request_router_kwargs": {
                    "app": app, "page_size": page, "salt": salt,
                    "tokenizer": str(tokenizer), **(weights or {}),
                },
            }  # fmt: skip
        deployment["request_router_config"] = options
    experimental = {**llm_config.experimental_configs, INDEX_KEY: app}
    return llm_config.model_copy(
        update={
            "server_cls": HiCacheLLMServer,
            "deployment_config": deployment,
            "experimental_configs": experimental,
        }
    )


def build_vllm_app(args: dict[str, str]) -> Any:
    """The Serve app of ``hicache-ray serve --engine vllm`` (serve options ``args``, checked
    by :func:`~hicache_ray.serving.serve_options.vllm_serve_spec`): Ray LLM's OpenAI app
    over the cluster's replicas."""
    from ray.serve.llm import LLMConfig

    spec = vllm_serve_spec(args)
    config = LLMConfig(
        model_loading_config={"model_id": spec["served_name"], "model_source": spec["model"]},
        placement_group_config={"bundles": spec["bundles"]},
        engine_kwargs=spec["engine_kwargs"],
        # the replica's own process takes no CPU of its bundle: the engine has them
        deployment_config={"num_replicas": spec["replicas"], "ray_actor_options": {"num_cpus": 0}},
    )
    cluster = vllm_cluster_config(config, f"vllm-{os.getpid()}", spec["router"], spec["weights"])
    return cluster_app([cluster])


def cluster_app(llm_configs: list[Any], **builder: Any) -> Any:
    """Ray LLM's OpenAI app (``build_openai_app``) over ``llm_configs`` (each made by
    :func:`vllm_cluster_config`), with :class:`HiCacheIngress` as its ingress; ``builder``:
    the builder's other arguments (``ingress_deployment_config``, ...)."""
    from ray.serve.llm import build_openai_app

    if "ingress_cls_config" in builder:
        raise ConfigError(
            "ingress_cls_config",
            builder["ingress_cls_config"],
            "the cluster's ingress is HiCacheIngress",
            "leave it out, or call build_openai_app yourself",
        )
    ingress = {"ingress_cls": HiCacheIngress}
    return build_openai_app({"llm_configs": llm_configs, "ingress_cls_config": ingress, **builder})


class HiCacheIngress(OpenAiIngress):
    """Ray LLM's OpenAI ingress, sending a call again (to the replica the router picks now)
    when the replica it went to died before its first response (:mod:`actors.resend`)."""

    def _get_response(self, **call: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        return resent_stream(lambda: super(HiCacheIngress, self)._get_response(**call))


def drop_cluster_store(args: dict[str, str]) -> None:
    """The ray L3 store of ``hicache-ray serve --engine vllm`` (serve options ``args``),
    dropped unless ``keep_store``."""
    if args.get("keep_store") == "True":
        return
    transfer = vllm_serve_spec(args)["engine_kwargs"]["kv_transfer_config"]
    options = transfer["kv_connector_extra_config"]
    if options["store"] == "ray":
        drop_store(options["ray"]["name"])


def _joining_this_cluster(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The connector's options with the GCS of the cluster this replica runs in as
    ``ray_address`` (unless one is given): vLLM's engine processes are not Ray workers and
    would join ``auto``, the cluster the node's last ``ray start`` or ``ray.init`` wrote
    down, which need not be this one (a bench's engine hung joining a stale one)."""
    import ray

    transfer = engine_kwargs.get("kv_transfer_config")
    if not isinstance(transfer, dict):
        return {}
    extra = transfer.get("kv_connector_extra_config")
    if not isinstance(extra, dict) or extra.get("store", "ray") != "ray":
        return {}
    store = extra.get("ray")
    if extra.get("ray_address") or (isinstance(store, dict) and store.get("address")):
        return {}
    extra = {**extra, "ray_address": ray.get_runtime_context().gcs_address}
    return {"kv_transfer_config": {**transfer, "kv_connector_extra_config": extra}}


def named_answer(item: Any, replica: str) -> Any:
    """``item`` of a completion or chat answer (a streamed batch of ``data: {json}`` lines,
    one such line, or a whole response) with ``replica`` named in its usage's
    ``prompt_tokens_details`` (``hicache.replica``, as this library's own engine names
    it); an item without those details (every chunk of a stream but its usage's, errors)
    is returned as it is."""
    if isinstance(item, list):
        return [named_answer(one, replica) for one in item]
    if isinstance(item, str):
        if not item.startswith("data: ") or '"prompt_tokens_details":{' not in item:
            return item
        body = json.loads(item[len("data: ") :])
        details = (body.get("usage") or {}).get("prompt_tokens_details")
        if not isinstance(details, dict):
            return item
        details["hicache"] = {"replica": replica}
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
    details = getattr(getattr(item, "usage", None), "prompt_tokens_details", None)
    if details is not None:
        details.hicache = {"replica": replica}  # vLLM's models keep extra fields
    return item


async def _named_stream(
    stream: AsyncGenerator[Any, None], replica: str
) -> AsyncGenerator[Any, None]:
    async for item in stream:
        yield named_answer(item, replica)


class HiCacheLLMServer(LLMServer):
    """Ray LLM's ``LLMServer`` whose engine's KV events feed the application's index, and
    whose completion and chat answers name it (:func:`named_answer`)."""

    async def __init__(self, llm_config: Any, **kwargs: Any) -> None:  # type: ignore[misc]
        replica = serve.get_replica_context().replica_id.unique_id
        self._replica = replica
        # Linux's abstract socket names: nothing on disk that a killed replica leaves behind
        name = f"hicache-vllm-events-{uuid.uuid4().hex}"
        endpoint, replay = f"ipc://@{name}-pub", f"ipc://@{name}-replay"
        # this replica's copy of the config (the engine config it caches included)
        llm_config.update_engine_kwargs(
            kv_events_config={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": endpoint,
                "replay_endpoint": replay,
            },
            **_joining_this_cluster(llm_config.engine_kwargs),
        )
        engine_kwargs = llm_config.engine_kwargs
        # checked by vllm_cluster_config (a baseline cluster runs without the connector)
        salt = str(_connector_options(engine_kwargs, shared=False).get("tenant_salt", ""))
        self._journal = VllmJournal(int(engine_kwargs["block_size"]), salt)
        self._feed = VllmEventFeed(self._journal, endpoint, replay)
        self._feed.start()  # it connects before the engine binds: nothing is missed
        await super().__init__(llm_config, **kwargs)
        app = str(llm_config.experimental_configs.get(INDEX_KEY, ""))
        self._publisher = Publisher(self._journal, app, replica)
        self._publisher.start()

    async def _run_request(
        self,
        request: Any,
        *,
        engine_method: str,
        batch_output_stream: bool = False,
        raw_request_info: Any = None,
    ) -> AsyncGenerator[Any, None]:
        stream = await super()._run_request(
            request,
            engine_method=engine_method,
            batch_output_stream=batch_output_stream,
            raw_request_info=raw_request_info,
        )
        if engine_method not in ("completions", "chat"):
            return stream
        return _named_stream(stream, self._replica)

    async def __del__(self) -> None:
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            publisher.stop()
        feed = getattr(self, "_feed", None)
        if feed is not None:
            feed.stop()
        await super().__del__()


class VllmPrefixRouter(PrefixCacheAffinityRouter):
    """Ray's ``PrefixCacheAffinityRouter`` (the ``prefix`` router), also for token-id prompts:
    Ray's reads a list of token ids as empty text, and then fails every call with a
    division by zero (Ray 2.60), so no call is ever routed. Here such a prompt is its ids
    as text, one space after each, so a text prefix is a token prefix."""

    def _normalize_prompt_to_string(self, prompt: Any) -> str:
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return "".join(f"{t} " for t in prompt)
        return str(super()._normalize_prompt_to_string(prompt))


class VllmCacheRouter(CacheAwareRouter):
    """The cache router over Ray LLM's requests (see the module docstring); one more
    ``request_router_kwargs`` than :class:`CacheAwareRouter`: ``tokenizer``, the model's
    (a path or Hugging Face id, as vLLM loads it)."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._tokenizer_source = str(kwargs.get("tokenizer", ""))
        self._tokenizer: Any = None

    def _prompt(self, pending_request: PendingRequest | None) -> tuple[list[int], str] | None:
        request = pending_request.args[0] if pending_request and pending_request.args else None
        if request is None:
            return None
        salt = getattr(request, "cache_salt", None) or ""
        try:
            tokens = self._tokens(request)
        except Exception as exc:  # a prompt it cannot tokenize is routed by load alone
            log.debug("prompt not tokenized for routing: %s", exc)
            return None
        return (tokens, salt) if tokens else None

    def _tokens(self, request: Any) -> list[int] | None:
        prompt = getattr(request, "prompt", None)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        messages = getattr(request, "messages", None)
        if not isinstance(prompt, str) and messages is None:
            return None  # batches of prompts, embeddings: nothing to place by
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_source)
        tok = self._tokenizer
        special = bool(getattr(request, "add_special_tokens", messages is None))
        if messages is not None:
            prompt = tok.apply_chat_template(
                [dict(m) for m in messages],
                tokenize=False,
                add_generation_prompt=bool(getattr(request, "add_generation_prompt", True)),
            )
        return list(tok(prompt, add_special_tokens=special)["input_ids"])
