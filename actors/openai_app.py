"""An OpenAI-compatible app on Ray Serve: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streamed as server-sent events with ``"stream": true``).

One replica owns one :class:`~actors.deployment.Deployment` (its ranks' bundles are the
replica's ``placement_group_bundles``) and the checkpoint's tokenizer. ``usage`` carries
``prompt_tokens_details.cached_tokens``: the prompt tokens served from L1, L2 or L3. Errors
use OpenAI's format: 400 for a bad body or a prompt longer than the context, 404 for an
unknown model or path, 413 for a body over ``MAX_BODY_BYTES``, 503 with ``Retry-After`` when
overloaded (the admission queue is full) or the deployment cannot serve, 500 when a request
fails inside, 401 without a valid key when the door has keys (checked before the body is
read; each key's tenant has a cache of its own: :mod:`hicache_ray.serving.tenants`). A
stream sends nothing until the engine's first chunk, so every refusal is a status. A
replica takes ``max_running + max_queued`` requests at once (:func:`max_ongoing_requests`),
so HTTP clients get the engine's batching and queue. Behind several engine replicas, a
call whose replica dies before answering is sent again (:mod:`actors.resend`).

    serve run actors.openai_app:build_app model=/path/to/checkpoint tp=2
    hicache-ray serve --model /path/to/checkpoint --tp 2      # the same, from the CLI
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import RayTaskError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from actors.deployment import Deployment
from actors.http_body import read_body
from actors.openai_engine import RETRY_AFTER_S, EngineCall, OpenAIEngine, parse_call, prepend
from actors.pd import PDConfig, PDDeployment, PDDoor
from actors.resend import resent_call, resent_stream
from actors.stores import drop_store, set_quotas
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.serving.openai.protocol import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    error_body,
    models_response,
)
from hicache_ray.serving.openai.text import text_codec
from hicache_ray.serving.pd_split import SplitPolicy
from hicache_ray.serving.serve_options import PDServe
from hicache_ray.serving.tenants import ApiKeys, KeySpec, Tenant, tenant_owner

__all__ = [
    "MAX_BODY_BYTES",
    "OpenAIApp",
    "OpenAIIngress",
    "build_app",
    "max_ongoing_requests",
    "serve_app",
]

MAX_BODY_BYTES = 4 << 20  # bodies up to 4x this are read to their end first (http_body.py)
log = logging.getLogger(__name__)
NO_KEYS = KeySpec()  # a door every caller may use


def _error(error: OpenAIError) -> JSONResponse:
    headers = None if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


class _Front(ABC):
    """The HTTP side: keys, routes, the body limit, parsing and tokenizing, errors as
    statuses; ``_respond`` and ``_events`` run the call (on this replica or on an engine
    replica). ``keys``: :class:`KeySpec`'s digests and keys file (none: no key needed)."""

    def __init__(
        self, config: DeploymentConfig, served_name: str, keep_store: bool, keys: KeySpec
    ) -> None:
        self.config = config
        self.model = served_name or config.model.name
        self.keep_store = keep_store
        self.codec = text_codec(config.model.checkpoint)
        self.created = int(time.time())
        self.keys = ApiKeys(keys.digests, keys.path, on_change=self._quotas)

    def _quotas(self, tenants: list[Tenant]) -> None:
        """Give the L3 store the tenants' quotas (each time the keys file is read)."""
        storage = self.config.cache.storage
        quotas = {tenant_owner(storage.tenant_salt, t): t.quota_bytes for t in tenants}
        if storage.backend == "ray":
            set_quotas(storage.ray, {o: q for o, q in quotas.items() if q})
        elif any(quotas.values()):
            log.warning(
                "tenant quotas apply to the ray L3 only; the %s L3 ignores them", storage.backend
            )

    async def __call__(self, request: Request) -> Response:
        try:
            try:  # before anything else: a caller without a key costs nothing more
                tenant = self.keys.tenant(request.headers.get("authorization"))
            except PermissionError as exc:
                raise OpenAIError(401, str(exc), code="invalid_api_key") from None
            path, method = request.url.path.rstrip("/"), request.method
            if path == "/v1/models" and method == "GET":
                return JSONResponse(models_response(self.model, self.created))
            if path == "/v1/completions" and method == "POST":
                return await self._serve(request, CompletionRequest, tenant)
            if path == "/v1/chat/completions" and method == "POST":
                return await self._serve(request, ChatRequest, tenant)
            raise OpenAIError(404, f"no route {method} {path}", code="not_found")
        except OpenAIError as exc:
            return _error(exc)

    async def _serve(
        self,
        request: Request,
        kind: type[CompletionRequest] | type[ChatRequest],
        tenant: Tenant | None,
    ) -> Response:
        raw = await self._read(request)
        call = parse_call(raw, kind, self.codec, self.config, self.model, tenant)
        if call.stream:
            events = self._events(call)
            first = await anext(events)  # refusals surface as statuses, not half streams
            return StreamingResponse(prepend(first, events), media_type="text/event-stream")
        return JSONResponse(await self._respond(call))

    async def _read(self, request: Request) -> bytes:
        data = await read_body(request, MAX_BODY_BYTES)
        if data is None:
            raise OpenAIError(413, f"the body is over {MAX_BODY_BYTES} bytes", code="too_large")
        return data

    @abstractmethod
    async def _respond(self, call: EngineCall) -> dict[str, Any]:
        """The JSON body of a non-streamed call."""

    @abstractmethod
    def _events(self, call: EngineCall) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed call (nothing before the first chunk)."""

    def _drop_store(self) -> None:
        if not self.keep_store and self.config.cache.storage.backend == "ray":
            drop_store(self.config.cache.storage.ray.name)


class OpenAIApp(_Front):
    """One replica: a deployment of ``config`` behind the OpenAI API (see the module
    docstring). ``served_name`` is the model name clients use (default: the model's name);
    the L3 store is dropped at shutdown unless ``keep_store``."""

    def __init__(
        self,
        config: DeploymentConfig,
        served_name: str = "",
        keep_store: bool = False,
        keys: KeySpec = NO_KEYS,
        pd: PDServe | None = None,
    ) -> None:
        super().__init__(config, served_name, keep_store, keys)
        self.deployment: Deployment | PDDoor
        if pd is None:
            self.deployment = Deployment.launch(config)
        else:
            pp, policy = config.pp_size, SplitPolicy(min_uncached_tokens=pd.min_uncached_tokens)
            pair = PDConfig.pair(
                config,
                prefill_tp=pd.prefill_tp,
                decode_tp=pd.decode_tp,
                prefill_pp=pp,
                decode_pp=pp,
                policy=policy,
                prefill_replicas=pd.prefill_replicas,
            )
            self.deployment = PDDoor(PDDeployment.launch(pair))
        self.engine = OpenAIEngine(self.deployment, self.codec)

    async def _respond(self, call: EngineCall) -> dict[str, Any]:
        return await self.engine.respond(call)

    def _events(self, call: EngineCall) -> AsyncIterator[bytes]:
        return self.engine.events(call)

    def __del__(self) -> None:
        self.deployment.shutdown()
        self._drop_store()


class OpenAIIngress(_Front):
    """The HTTP side of several replicas: it parses and tokenizes, and the handle of the
    engine deployment (``actors.routing.EngineReplica``) routes each call to a replica
    by its router. The shared L3 store is dropped at shutdown unless ``keep_store``."""

    def __init__(
        self,
        engine: Any,
        config: DeploymentConfig,
        served_name: str = "",
        keep_store: bool = False,
        keys: KeySpec = NO_KEYS,
    ) -> None:
        super().__init__(config, served_name, keep_store, keys)
        self.engine = engine

    async def _respond(self, call: EngineCall) -> dict[str, Any]:
        try:  # sent again if its replica dies first (actors.resend)
            body: dict[str, Any] = await resent_call(lambda: self.engine.respond.remote(call))
        except Exception as exc:
            raise _remote_error(exc) from None
        return body

    async def _events(self, call: EngineCall) -> AsyncIterator[bytes]:
        stream = self.engine.options(stream=True).events
        try:  # sent again if its replica dies before the first event (actors.resend)
            async for event in resent_stream(lambda: stream.remote(call)):
                yield event
        except Exception as exc:
            raise _remote_error(exc) from None

    def __del__(self) -> None:
        self._drop_store()


def _remote_error(exc: Exception) -> OpenAIError:
    """What an engine replica's failure is to the client: its own OpenAI error, or 503
    (no replica could take the call: the client retries)."""
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    if isinstance(cause, OpenAIError):
        return cause
    return OpenAIError(
        503, f"{type(cause).__name__}: {cause}", kind="server_error", retry_after_s=RETRY_AFTER_S
    )


def max_ongoing_requests(config: DeploymentConfig) -> int:
    """What one replica takes at once: the requests its deployment runs plus those its
    admission queue holds (``scheduler.max_running + scheduler.max_queued``)."""
    return config.scheduler.max_running + config.scheduler.max_queued


def serve_app(
    config: DeploymentConfig,
    served_name: str = "",
    keep_store: bool = False,
    replicas: int = 1,
    router: str = "cache",
    weights: dict[str, float] | None = None,
    ingresses: int = 1,
    keys: KeySpec = NO_KEYS,
    pd: PDServe | None = None,
) -> Any:
    """The Serve application serving ``config``, ready for ``serve.run``: one replica
    (bundles for its ranks, ``max_ongoing_requests`` from its limits), or with
    ``replicas`` > 1 ``ingresses`` ingress replicas in front of that many engine replicas,
    each with its own ranks, routed by ``router`` (:mod:`actors.routing`; ``weights``: the
    cache router's; every ingress replica routes with its own router instance). ``keys``:
    the API keys the HTTP door asks for (none: every caller is let in). ``pd``: a
    prefill/decode pair (:mod:`actors.pd`; its TP sizes and split threshold) serving as the
    one replica instead of one deployment (its sides make their own placement groups)."""
    from actors.routing import EngineReplica, router_config

    bundles = [
        {"CPU": config.cpus_per_rank, "GPU": float(config.gpus_per_rank)}
        if config.gpus_per_rank
        else {"CPU": config.cpus_per_rank}
    ] * config.world_size
    # Every request the engine can run or queue reaches it (its admission queue answers
    # the rest with 503 + Retry-After); Serve's default of 5 would cap batching at 5.
    ongoing = max_ongoing_requests(config)
    placed: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": 0},
        "placement_group_bundles": bundles,
        "placement_group_strategy": "PACK",
    }
    if pd is not None:
        placed = {"ray_actor_options": {"num_cpus": 0}}
    if replicas == 1:
        one: Any = serve.deployment(
            OpenAIApp, name="hicache-openai", max_ongoing_requests=ongoing, **placed
        )
        return one.bind(config, served_name, keep_store, keys, pd)
    routing = router_config(router, config.name, config, weights or {})
    if routing is not None:  # pow2: Serve's default router
        placed["request_router_config"] = routing
    engine: Any = serve.deployment(
        EngineReplica,
        name="hicache-engine",
        num_replicas=replicas,
        max_ongoing_requests=ongoing,
        **placed,
    )
    ingress: Any = serve.deployment(
        OpenAIIngress,
        name="hicache-openai",
        num_replicas=ingresses,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=ongoing * replicas,
    )
    return ingress.bind(engine.bind(config, config.name), config, served_name, keep_store, keys)


def build_app(args: dict[str, str]) -> Any:
    """The app builder of ``serve run actors.openai_app:build_app key=value ...`` (and of
    ``hicache-ray serve``): ``model`` (a preset or a checkpoint directory), ``tp``, ``pp``,
    ``storage`` (``ray``, ``file`` or ``none``), ``storage_root``, ``store``,
    ``device_tokens``, ``page_size``, ``served_name``, ``keep_store``, ``max_queued``,
    ``replicas``, ``router``, ``ingresses``, ``route_weights``, ``api_keys``,
    ``api_key_sha256``."""
    from hicache_ray.serving.serve_options import (
        serve_deployment_config,
        serve_ingresses,
        serve_keys,
        serve_pd,
        serve_replicas,
    )

    keep = args.get("keep_store", "false").lower() in ("1", "true", "yes")
    replicas, router, weights = serve_replicas(args)
    config = serve_deployment_config(args)
    served = args.get("served_name", "")
    keys = serve_keys(args)
    ingresses, pd = serve_ingresses(args), serve_pd(args)
    return serve_app(config, served, keep, replicas, router, weights, ingresses, keys, pd)
