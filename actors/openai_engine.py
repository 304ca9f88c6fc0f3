"""The engine side of the OpenAI app: a parsed, tokenized request (:class:`EngineCall`) run
on one deployment, answered as a JSON body or as server-sent events.

The HTTP side (:mod:`actors.openai_app`) reads and checks the body and tokenizes it
(:func:`parse_call`); one replica runs the call on its own deployment, or hands it to one
of several engine replicas through a Serve handle (:mod:`actors.routing`), whose router
reads the call: its ``request.tokens`` (the cache router) or its ``messages`` / ``prompt``
(Ray's ``PrefixCacheAffinityRouter``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, TypeVar

from actors.lifecycle import DeploymentError
from hicache_ray.engine.request import (
    ErrorKind,
    GenerateRequest,
    RequestResult,
    SamplingParams,
    StreamChunk,
)
from hicache_ray.engine.spec import DeploymentConfig
from hicache_ray.serving.openai.protocol import (
    MAX_TOKENS_DEFAULT,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    decode_body,
    new_id,
    sse,
    usage,
)
from hicache_ray.serving.openai.text import IncrementalText, TextCodec
from hicache_ray.serving.tenants import Tenant, request_salt

__all__ = ["ChatCall", "CompletionCall", "EngineCall", "OpenAIEngine", "parse_call"]

CHAT_MAX_TOKENS_DEFAULT = 256
RETRY_AFTER_S = 1  # what a 503 asks the client to wait before trying again

_T = TypeVar("_T")


@dataclass(frozen=True)
class EngineCall:
    """One OpenAI request, checked and tokenized.

    Attributes:
        request: what the deployment runs (its ``rid`` is the response's id).
        model: the served model name the response carries.
        stream: answer as server-sent events.
        include_usage: a stream's last event carries ``usage``.
        stops: stop strings.
    """

    request: GenerateRequest
    model: str
    stream: bool = False
    include_usage: bool = False
    stops: list[str] = field(default_factory=list)

    @property
    def chat(self) -> bool:
        return False


@dataclass(frozen=True)
class CompletionCall(EngineCall):
    """A ``/v1/completions`` call; ``text``: its prompt where the client sent text."""

    text: str = ""

    @cached_property
    def prompt(self) -> str:
        """What Ray's prefix router reads: the client's text, or the prompt's token ids
        written out where it sent none (:func:`_routed_text`)."""
        return self.text or _routed_text(self.request.tokens)


@dataclass(frozen=True)
class ChatCall(EngineCall):
    """A ``/v1/chat/completions`` call; ``sent``: its messages as the client sent them."""

    sent: list[dict[str, str]] = field(default_factory=list)

    @cached_property
    def messages(self) -> list[dict[str, str]]:
        """What Ray's prefix router reads: the messages as sent, or one message of the
        prompt's token ids written out where none holds text (:func:`_routed_text`)."""
        if any(m["content"] for m in self.sent):
            return self.sent
        return [{"role": "user", "content": _routed_text(self.request.tokens)}]

    @property
    def chat(self) -> bool:
        return True


def parse_call(
    raw: bytes,
    kind: type[CompletionRequest] | type[ChatRequest],
    codec: TextCodec,
    config: DeploymentConfig,
    model: str,
    tenant: Tenant | None = None,
) -> EngineCall:
    """The call of an HTTP body from ``tenant`` (None: a door without keys); raises
    :class:`OpenAIError` (4xx) for a bad one."""
    body = decode_body(raw, kind)
    if body.model != model:
        raise OpenAIError(
            404,
            f"the model {body.model!r} does not exist; this server has {model!r}",
            param="model",
            code="model_not_found",
        )
    chat = isinstance(body, ChatRequest)
    tokens = codec.encode_chat(body.messages) if chat else codec.encode(body.prompt)
    if not tokens:  # refused here: no router could place it (Ray's prefix router stalls)
        raise OpenAIError(400, "the prompt is empty: give at least one token", param="prompt")
    limit = body.max_completion_tokens if chat else None
    if limit is None:
        limit = body.max_tokens
    max_new = limit or (CHAT_MAX_TOKENS_DEFAULT if chat else MAX_TOKENS_DEFAULT)
    context = config.model.max_context
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
    salt = request_salt(config.cache.storage.tenant_salt, tenant, body.cache_salt or "")
    rid = new_id("chatcmpl" if chat else "cmpl")
    request = GenerateRequest(rid, tokens, max_new, sampling, cache_salt=salt)
    include = body.stream_options is not None and body.stream_options.include_usage
    common: dict[str, Any] = {
        "request": request,
        "model": model,
        "stream": body.stream,
        "include_usage": include,
        "stops": [body.stop] if isinstance(body.stop, str) else list(body.stop or []),
    }
    if isinstance(body, ChatRequest):
        sent = [{"role": m.role, "content": m.content} for m in body.messages]
        return ChatCall(**common, sent=sent)
    return CompletionCall(**common, text=body.prompt if isinstance(body.prompt, str) else "")


def _routed_text(tokens: list[int]) -> str:
    """The text a call shows Ray's prefix router when its client sent none (token ids, or
    messages with empty contents): the prompt's token ids written out. That router reads
    text only, and a call without any never leaves it (a division by zero in its loop,
    ray-project/ray#64573): the client would wait until it gave up. Written only when
    that router asks (0.7 ms for 4,096 tokens)."""
    return " ".join(map(str, tokens))


class EngineDoor(Protocol):
    """What the engine calls: a :class:`~actors.deployment.Deployment`, or a
    prefill/decode pair as one (:class:`~actors.pd.PDDoor`)."""

    async def generate_async(self, request: GenerateRequest) -> RequestResult: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]: ...

    def abort(self, rid: str) -> None: ...


class OpenAIEngine:
    """Runs calls on one deployment and answers them in OpenAI's format."""

    def __init__(self, deployment: EngineDoor, codec: TextCodec, replica: str = "") -> None:
        self.deployment = deployment
        self.codec = codec
        self.replica = replica  # named in each answer's usage ("": one replica)

    def _tiers(self, result: RequestResult) -> dict[str, Any]:
        return {
            "device": result.device_hit_tokens,
            "host": result.host_hit_tokens,
            "storage": result.storage_hit_tokens,
            "replica": self.replica,
        }

    async def respond(self, call: EngineCall) -> dict[str, Any]:
        """The JSON body of a non-streamed call."""
        text = IncrementalText(self.codec, call.stops)
        result = await self._run(call.request, text)
        out = text.text + (text.finish() if not text.stopped else "")
        reason = "stop" if text.stopped else str(result.finish_reason)
        prompt = len(call.request.tokens)
        use = usage(prompt, _completion_tokens(result, text), **self._tiers(result))
        build = chat_response if call.chat else completion_response
        return build(call.request.rid, call.model, out, reason, use)

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

    async def events(self, call: EngineCall) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed call. Nothing is yielded before the
        engine's first chunk (the request was admitted and prefilled): a refusal before it
        raises, so the HTTP side answers it with a status, never a cut stream."""
        request, chat, model = call.request, call.chat, call.model
        rid, text = request.rid, IncrementalText(self.codec, call.stops)
        chunks = self._stream(request)
        first = await anext(chunks)
        if chat:
            yield sse(chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
        result = None
        async for chunk in prepend(first, chunks):
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
        reason = "stop" if text.stopped else str(result.finish_reason)
        yield sse(
            chat_chunk(rid, model, {"content": rest} if rest else {}, reason)
            if chat
            else completion_chunk(rid, model, rest, reason)
        )
        if call.include_usage:
            completion = _completion_tokens(result, text)
            use = usage(len(request.tokens), completion, **self._tiers(result))
            yield sse(
                chat_chunk(rid, model, {}, None, use)
                if chat
                else completion_chunk(rid, model, "", None, use)
            )
        yield sse("[DONE]")


def _checked(result: RequestResult) -> RequestResult:
    """``result``, or the OpenAI error of its failure (503 with Retry-After: overloaded)."""
    if result.error is None:
        return result
    status = (result.error_kind or ErrorKind.INTERNAL).http_status
    kind = "invalid_request_error" if status == 400 else "server_error"
    retry = RETRY_AFTER_S if status == 503 else None
    raise OpenAIError(status, result.error, kind=kind, retry_after_s=retry)


def _unavailable(exc: DeploymentError) -> OpenAIError:
    """A deployment that cannot serve (shut down, or no retry left): 503."""
    return OpenAIError(503, str(exc), kind="server_error", retry_after_s=RETRY_AFTER_S)


def _completion_tokens(result: RequestResult, text: IncrementalText) -> int:
    return len(text.tokens) if text.stopped else len(result.output_tokens)


async def prepend(first: _T, rest: AsyncIterator[_T]) -> AsyncIterator[_T]:
    """``first``, then what ``rest`` yields."""
    yield first
    async for event in rest:
        yield event
