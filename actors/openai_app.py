"""An OpenAI-compatible app on Ray Serve: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streamed as server-sent events with ``"stream": true``).

One replica owns one :class:`~actors.deployment.Deployment` (its ranks' bundles are the
replica's ``placement_group_bundles``) and the checkpoint's tokenizer. ``usage`` carries
``prompt_tokens_details.cached_tokens``: the prompt tokens served from L1, L2 or L3. Errors
use OpenAI's format: 400 for a bad body or a prompt longer than the context, 404 for an
unknown model or path, 413 for a body over ``MAX_BODY_BYTES``, 503 with ``Retry-After`` when
overloaded (the admission queue is full) or the deployment cannot serve, 500 when a request
fails inside. A stream sends nothing until the engine's first chunk, so every refusal is a
status. A replica takes ``max_running + max_queued`` requests at once
(:func:`max_ongoing_requests`), so HTTP clients get the engine's batching and queue.

    serve run actors.openai_app:build_app model=/path/to/checkpoint tp=2
    hicache-ray serve --model /path/to/checkpoint --tp 2      # the same, from the CLI
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from actors.deployment import Deployment, DeploymentError
from actors.stores import drop_store
from hicache_ray.openai.protocol import (
    MAX_TOKENS_DEFAULT,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    decode_body,
    error_body,
    models_response,
    new_id,
    sse,
    usage,
)
from hicache_ray.openai.text import IncrementalText, text_codec
from hicache_ray.request import (
    ErrorKind,
    GenerateRequest,
    RequestResult,
    SamplingParams,
    StreamChunk,
)
from hicache_ray.spec import DeploymentConfig

__all__ = [
    "MAX_BODY_BYTES",
    "OpenAIApp",
    "build_app",
    "max_ongoing_requests",
    "serve_app",
]

MAX_BODY_BYTES = 4 << 20
CHAT_MAX_TOKENS_DEFAULT = 256


_T = TypeVar("_T")
_RETRY_AFTER_S = 1  # what a 503 asks the client to wait before trying again


def _error(error: OpenAIError) -> JSONResponse:
    headers = None if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


class OpenAIApp:
    """The replica: a deployment of ``config`` behind the OpenAI API (see the module
    docstring). ``served_name`` is the model name clients use (default: the model's name);
    the L3 store is dropped at shutdown unless ``keep_store``."""

    def __init__(
        self, config: DeploymentConfig, served_name: str = "", keep_store: bool = False
    ) -> None:
        self.config = config
        self.model = served_name or config.model.name
        self.keep_store = keep_store
        self.codec = text_codec(config.model.checkpoint)
        self.deployment = Deployment.launch(config)
        self.created = int(time.time())

    async def __call__(self, request: Request) -> Response:
        try:
            path, method = request.url.path.rstrip("/"), request.method
            if path == "/v1/models" and method == "GET":
                return JSONResponse(models_response(self.model, self.created))
            if path == "/v1/completions" and method == "POST":
                return await self._serve(request, CompletionRequest)
            if path == "/v1/chat/completions" and method == "POST":
                return await self._serve(request, ChatRequest)
            raise OpenAIError(404, f"no route {method} {path}", code="not_found")
        except OpenAIError as exc:
            return _error(exc)

    async def _serve(
        self, request: Request, kind: type[CompletionRequest] | type[ChatRequest]
    ) -> Response:
        body = decode_body(await self._read(request), kind)
        if body.model != self.model:
            raise OpenAIError(
                404,
                f"the model {body.model!r} does not exist; this server has {self.model!r}",
                param="model",
                code="model_not_found",
            )
        chat = isinstance(body, ChatRequest)
        tokens = self.codec.encode_chat(body.messages) if chat else self.codec.encode(body.prompt)
        limit = body.max_completion_tokens if chat else None
        if limit is None:
            limit = body.max_tokens
        max_new = limit or (CHAT_MAX_TOKENS_DEFAULT if chat else MAX_TOKENS_DEFAULT)
        context = self.config.model.max_context
        if context and len(tokens) >= context:
            raise OpenAIError(
                400,
                f"the prompt has {len(tokens)} tokens; the model's context is {context}",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        if context:
            max_new = min(max_new, context - len(tokens))
        sampling = SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed
        )
        rid = new_id("chatcmpl" if chat else "cmpl")
        generate = GenerateRequest(rid, tokens, max_new, sampling)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        text = IncrementalText(self.codec, stops)
        if body.stream:
            include = body.stream_options is not None and body.stream_options.include_usage
            events = self._events(generate, text, chat, include)
            first = await anext(events)  # refusals surface as statuses, not half streams
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream")
        result = await self._run(generate, text)
        out = text.text + (text.finish() if not text.stopped else "")
        reason = "stop" if text.stopped else result.finish_reason
        use = usage(len(tokens), _completion_tokens(result, text), result.cached_tokens)
        build = chat_response if chat else completion_response
        return JSONResponse(build(rid, self.model, out, reason, use))

    async def _read(self, request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise OpenAIError(413, f"the body is over {MAX_BODY_BYTES} bytes", code="too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise OpenAIError(413, f"the body is over {MAX_BODY_BYTES} bytes", code="too_large")
        return bytes(data)

    async def _run(self, request: GenerateRequest, text: IncrementalText) -> RequestResult:
        """Run to the end (or the first stop string, which aborts the rest). Without stop
        strings the answer comes in one piece (one Ray call, not one per token)."""
        if not text.stops:
            try:
                result = _checked(await self.deployment.generate_async(request))
            except DeploymentError as exc:
                raise _unavailable(exc) from None
            text.add(result.output_tokens)
            return result
        async for chunk in self._stream(request):
            text.add(chunk.tokens)
            if text.stopped:
                self.deployment.abort(request.rid)
            if chunk.result is not None:
                return chunk.result
        raise OpenAIError(500, "the request ended without a result", kind="server_error")

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        try:
            async for chunk in self.deployment.stream(request):
                if chunk.result is not None:
                    _checked(chunk.result)
                yield chunk
        except DeploymentError as exc:
            raise _unavailable(exc) from None

    async def _events(
        self, request: GenerateRequest, text: IncrementalText, chat: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        rid, model = request.rid, self.model
        # NOTE: nothing is sent before the engine's first chunk (the request was admitted
        # and prefilled): a refusal before it is an HTTP status, not a cut stream.
        chunks = self._stream(request)
        first = await anext(chunks)
        if chat:
            yield sse(chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
        result = None
        async for chunk in _prepend(first, chunks):
            piece = text.add(chunk.tokens)
            if text.stopped and chunk.result is None:
                self.deployment.abort(rid)
            if piece:
                yield sse(
                    chat_chunk(rid, model, {"content": piece}, None)
                    if chat
                    else completion_chunk(rid, model, piece, None)
                )
            if chunk.result is not None:
                result = chunk.result
                break
        assert result is not None
        rest = "" if text.stopped else text.finish()
        reason = "stop" if text.stopped else result.finish_reason
        yield sse(
            chat_chunk(rid, model, {"content": rest} if rest else {}, reason)
            if chat
            else completion_chunk(rid, model, rest, reason)
        )
        if include_usage:
            use = usage(len(request.tokens), _completion_tokens(result, text), result.cached_tokens)
            yield sse(
                chat_chunk(rid, model, {}, None, use)
                if chat
                else completion_chunk(rid, model, "", None, use)
            )
        yield sse("[DONE]")

    def __del__(self) -> None:
        self.deployment.shutdown()
        if not self.keep_store and self.config.cache.storage.backend == "ray":
            drop_store(self.config.cache.storage.ray.name)


def _checked(result: RequestResult) -> RequestResult:
    """``result``, or the OpenAI error of its failure (503 with Retry-After: overloaded)."""
    if result.error is None:
        return result
    status = (result.error_kind or ErrorKind.INTERNAL).http_status
    kind = "invalid_request_error" if status == 400 else "server_error"
    retry = _RETRY_AFTER_S if status == 503 else None
    raise OpenAIError(status, result.error, kind=kind, retry_after_s=retry)


def _unavailable(exc: DeploymentError) -> OpenAIError:
    """A deployment that cannot serve (shut down, or no retry left): 503."""
    return OpenAIError(503, str(exc), kind="server_error", retry_after_s=_RETRY_AFTER_S)


def _completion_tokens(result: RequestResult, text: IncrementalText) -> int:
    return len(text.tokens) if text.stopped else len(result.output_tokens)


async def _prepend(first: _T, rest: AsyncIterator[_T]) -> AsyncIterator[_T]:
    yield first
    async for event in rest:
        yield event


def max_ongoing_requests(config: DeploymentConfig) -> int:
    """What one replica takes at once: the requests its deployment runs plus those its
    admission queue holds (``scheduler.max_running + scheduler.max_queued``)."""
    return config.scheduler.max_running + config.scheduler.max_queued


def serve_app(config: DeploymentConfig, served_name: str = "", keep_store: bool = False) -> Any:
    """The Serve application of one replica serving ``config`` (bundles for its ranks,
    ``max_ongoing_requests`` from its limits), ready for ``serve.run``."""
    bundles = [
        {"CPU": config.cpus_per_rank, "GPU": float(config.gpus_per_rank)}
        if config.gpus_per_rank
        else {"CPU": config.cpus_per_rank}
    ] * config.world_size
    app: Any = serve.deployment(
        OpenAIApp,
        name="hicache-openai",
        ray_actor_options={"num_cpus": 0},
        # Every request the engine can run or queue reaches it (its admission queue answers
        # the rest with 503 + Retry-After); Serve's default of 5 would cap batching at 5.
        max_ongoing_requests=max_ongoing_requests(config),
        placement_group_bundles=bundles,
        placement_group_strategy="PACK",
    )
    return app.bind(config, served_name, keep_store)


def build_app(args: dict[str, str]) -> Any:
    """The app builder of ``serve run actors.openai_app:build_app key=value ...`` (and of
    ``hicache-ray serve``): ``model`` (a preset or a checkpoint directory), ``tp``, ``pp``,
    ``storage`` (``ray``, ``file`` or ``none``), ``storage_root``, ``store``,
    ``device_tokens``, ``page_size``, ``served_name``, ``keep_store``, ``max_queued``."""
    from hicache_ray.serve_options import serve_deployment_config

    keep = args.get("keep_store", "false").lower() in ("1", "true", "yes")
    return serve_app(serve_deployment_config(args), args.get("served_name", ""), keep)
