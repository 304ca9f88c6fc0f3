"""The OpenAI API as the Serve app speaks it: request bodies (decoded strictly), responses,
streamed chunks and errors.

Bodies are decoded with msgspec against these structs: a field of the wrong type is a 400
naming it (no coercion: ``"4"`` is not a number, ``1.5`` is not an integer); fields this
server does not know are ignored, as OpenAI's own server ignores unknown ones; values it
cannot honour (``n`` above 1, ``logprobs``) are refused. Every response field follows
OpenAI's schema; ``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens
served from the cache (L1, L2 or L3): the caller's own, since each tenant and each
``cache_salt`` (vLLM's field) has a cache of its own.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import msgspec

from hicache_ray.serving.tenants import check_cache_salt

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "Message",
    "OpenAIError",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "decode_body",
    "error_body",
    "models_response",
    "sse",
    "usage",
]

MAX_TOKENS_DEFAULT = 16
# NOTE: 0 is refused (400), not read as "unset": a client asking for no tokens is told so
# rather than silently given the default.
_TokenLimit = Annotated[int, msgspec.Meta(ge=1)] | None


class OpenAIError(Exception):
    """An error answered in OpenAI's format: ``status``, ``type``, the offending ``param``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code = param, code
        self.retry_after_s = retry_after_s  # sent as ``Retry-After`` (503s)


class Message(msgspec.Struct, frozen=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: _TokenLimit = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's: this call's cache namespace, within its tenant


class CompletionRequest(_Common, frozen=True, kw_only=True):
    """``POST /v1/completions``: a text prompt, or token ids."""

    prompt: str | list[int]


class ChatRequest(_Common, frozen=True, kw_only=True):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""

    messages: list[Message]
    max_completion_tokens: _TokenLimit = None


def decode_body(data: bytes, kind: type[CompletionRequest] | type[ChatRequest]) -> Any:
    """The request body, strictly decoded and checked.

    Raises:
        OpenAIError: 400 naming the field and the problem.
    """
    try:
        body = msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        raise OpenAIError(400, f"invalid request body: {exc}", param=_path(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise OpenAIError(400, "the body is not valid JSON: nested too deeply") from None
    if body.n != 1:
        raise OpenAIError(400, "only n=1 is supported", param="n")
    if body.logprobs:
        raise OpenAIError(400, "logprobs are not supported", param="logprobs")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > 4 or any(not s for s in stops):
        raise OpenAIError(400, "stop takes up to 4 non-empty strings", param="stop")
    if isinstance(body, ChatRequest) and not body.messages:
        raise OpenAIError(400, "messages is empty", param="messages")
    try:
        check_cache_salt(body.cache_salt or "")
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="cache_salt") from None
    return body


def _path(message: str) -> str | None:
    # msgspec says "... - at `$.field[0]`"
    _, _, where = message.partition("at `$.")
    return where.rstrip("`").split("[")[0] or None


def error_body(error: OpenAIError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error.kind,
            "param": error.param,
            "code": error.code,
        }
    }


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    *,
    device: int,
    host: int,
    storage: int,
    replica: str = "",
) -> dict[str, Any]:
    """OpenAI's usage object. ``cached_tokens`` is ``device + host`` (host hits include the
    tokens read from storage for the request); ``prompt_tokens_details.hicache`` (an
    extension clients ignore) splits it by the tier that served them: ``l1`` (device),
    ``l2`` (host) and ``l3`` (storage), and names the engine ``replica`` that served the
    call when there are several."""
    from_l3 = min(storage, host)
    tiers: dict[str, Any] = {"l1": device, "l2": host - from_l3, "l3": from_l3}
    if replica:
        tiers["replica"] = replica
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": device + host,
            "hicache": tiers,
        },
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def models_response(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "hicache-ray"}],
    }


def completion_response(
    rid: str, model: str, text: str, finish_reason: str, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
        "usage": use,
    }


def chat_response(
    rid: str, model: str, text: str, finish_reason: str, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": use,
    }


def completion_chunk(
    rid: str, model: str, text: str, finish_reason: str | None, use: dict[str, Any] | None = None
) -> dict[str, Any]:
    return _chunk("text_completion", rid, model, "text", text, finish_reason, use)


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None,
    use: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return _chunk("chat.completion.chunk", rid, model, "delta", delta, finish_reason, use)


def _chunk(
    kind: str,
    rid: str,
    model: str,
    field: str,
    content: str | dict[str, str],
    finish_reason: str | None,
    use: dict[str, Any] | None,
) -> dict[str, Any]:
    """One streamed chunk; the final usage-only chunk (``use`` with nothing else to say)
    has no choices, as OpenAI's has."""
    usage_only = use is not None and not content and finish_reason is None
    choice = {"index": 0, field: content, "finish_reason": finish_reason, "logprobs": None}
    chunk: dict[str, Any] = {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [] if usage_only else [choice],
    }
    if use is not None:
        chunk["usage"] = use
    return chunk


def sse(event: dict[str, Any] | str) -> bytes:
    """One server-sent event (``[DONE]`` for the end of a stream)."""
    data = event if isinstance(event, str) else msgspec.json.encode(event).decode()
    return f"data: {data}\n\n".encode()
