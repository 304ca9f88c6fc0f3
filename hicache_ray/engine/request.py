"""Requests as they enter a deployment, and the check every one passes first.

``GenerateRequest`` is a plain struct, so it can hold whatever a caller put in it; nothing
reaches a rank, let alone a collective, before :func:`check_request` has turned it into a
request of exactly the right types (token ids converted exactly from numpy or torch integer
arrays, never from floats, bools or strings) and :func:`check_limits` has checked it
against the model and the pool. A request that fails gets its own error result; the other
requests of the same call are served normally.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from hicache_ray.base.errors import HiCacheError

__all__ = [
    "FINISH_REASONS",
    "ErrorKind",
    "FinishReason",
    "MAX_NEW_TOKENS",
    "MAX_RID_CHARS",
    "MAX_TOKEN_ID",
    "GenerateRequest",
    "RequestError",
    "RequestResult",
    "SamplingParams",
    "StepOutput",
    "StreamChunk",
    "TTFTSplit",
    "check_batch",
    "check_limits",
    "check_request",
    "error_result",
    "failed_result",
]

MAX_SALT_CHARS = 1024  # GenerateRequest.cache_salt
MAX_RID_CHARS = 256
MAX_NEW_TOKENS = 1 << 20
MAX_TOKEN_ID = (1 << 32) - 1  # token ids are hashed as uint32


# Why a request ended: it generated max_new_tokens ("length"), an EOS or stop token
# ("stop"), its caller aborted it ("abort"), or it failed ("error", see ``error``).


class FinishReason(str, enum.Enum):
    """Why a request ended (``RequestResult.finish_reason``; OpenAI's ``finish_reason``)."""

    LENGTH = "length"  # max_new_tokens generated
    STOP = "stop"  # a stop token (or, over HTTP, a stop string)
    ABORT = "abort"  # its caller stopped it
    ERROR = "error"  # refused or failed: see ``error`` and ``error_kind``

    def __str__(self) -> str:
        return self.value


class ErrorKind(str, enum.Enum):
    """What kind of failure a result's ``error`` is, and its HTTP status."""

    INVALID = "invalid"  # the request itself: fix it (400)
    OVERLOADED = "overloaded"  # refused for now, the queue is full: retry later (503)
    INTERNAL = "internal"  # it failed while running (500)

    def __str__(self) -> str:
        return self.value

    @property
    def http_status(self) -> int:
        return {"invalid": 400, "overloaded": 503, "internal": 500}[self.value]


FINISH_REASONS = tuple(r.value for r in FinishReason)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How a request picks its tokens, and what ends it besides ``max_new_tokens``.

    Attributes:
        temperature: 0 (the default) is greedy, the exactness reference; above 0 samples
            from the softmax of logits / temperature.
        top_p: sample from the smallest set of tokens whose probability reaches it (1: all).
        top_k: sample from the k likeliest tokens (0: all).
        seed: seeds the request's generator; None derives one from the request id. Either
            way a sampled run is reproducible.
        stop_token_ids: tokens that end generation (besides the model's EOS tokens).
        ignore_eos: keep generating past the model's EOS tokens.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


class GenerateRequest(msgspec.Struct, frozen=True):
    """A prompt, how many tokens to generate, and how to pick them.

    Attributes:
        rid: the caller's id of the request: a non-empty ``str`` of at most 256
            characters, unique among the requests in flight.
        tokens: the prompt's token ids: a non-empty list of ``int`` (a 1-D numpy or torch
            integer array is accepted and converted exactly).
        max_new_tokens: tokens to generate, an ``int`` in ``[0, 2**20]``.
        sampling: greedy by default (see :class:`SamplingParams`).
        cache_salt: the request's cache namespace (vLLM's and SGLang's ``cache_salt``): a
            ``str`` of at most 1,024 characters. Requests of one salt share cached prefixes
            in every tier and never reach another salt's; ``""`` (the default) is the
            deployment's own (``StorageConfig.tenant_salt``). It names the L3 pages as
            SGLang's ``cache_salt`` does. The HTTP door sets it per tenant.
    """

    rid: str
    tokens: list[int]
    max_new_tokens: int = 16
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    cache_salt: str = ""


class TTFTSplit(msgspec.Struct, kw_only=True):
    """Where a request's time to first token went, in disjoint parts. The rank's parts add
    up to ``RequestResult.ttft_s`` (rank 0's clock, from taking the request out of its
    inbox); ``call_s``, set by the caller's door (the Ray layer's ``Deployment``), adds what
    the caller saw besides, so all parts add up to ``RequestResult.caller_ttft_s``.

    Attributes:
        call_s: the caller's door to rank 0's step loop and the first token back: the Ray
            calls, rank 0's inbox, re-forming after a rank failure (0 on the rank itself).
        queue_s: taken from the inbox to the start of the step that admits it (waiting for
            room in the device pool and for that step).
        agreement_s: the agreement rounds until it starts: the admitting step's, and the
            steps that agreed on its L3 query's answer and on its reads being done.
        query_s: admitted to its L3 query's answer (0 without an L3 lookup).
        prefetch_s: its L3 reads into L2, from their start to their end.
        load_s: its prefill steps stalled on L2 -> L1 loads of cached pages.
        forward_s: the forward passes of the steps that computed its prompt (a batched
            step counts whole: the request waited for all of it).
        rest_s: everything else: taking and reserving pages, scheduling, between steps.
    """

    call_s: float = 0.0
    queue_s: float = 0.0
    agreement_s: float = 0.0
    query_s: float = 0.0
    prefetch_s: float = 0.0
    load_s: float = 0.0
    forward_s: float = 0.0
    rest_s: float = 0.0

    @property
    def rank_s(self) -> float:
        """The rank's parts together: every part but ``call_s``."""
        return (
            self.queue_s
            + self.agreement_s
            + self.query_s
            + self.prefetch_s
            + self.load_s
            + self.forward_s
            + self.rest_s
        )

    def close(self, ttft_s: float) -> None:
        """Set ``rest_s``: what of the rank's ``ttft_s`` the other rank parts do not explain."""
        self.rest_s = 0.0
        self.rest_s = max(0.0, ttft_s - self.rank_s)


class RequestResult(msgspec.Struct, kw_only=True):
    """What one request produced and where its prefix came from.

    Attributes:
        rid: the request's id (empty when the id itself was what was wrong).
        output_tokens: generated token ids.
        device_hit_tokens / host_hit_tokens / storage_hit_tokens: cached prompt tokens by
            tier (host hits include tokens prefetched from storage into the host pool).
        recomputed_tokens: prompt tokens computed by the prefill.
        ttft_s: rank 0's clock, from taking it out of its inbox to its first token;
            ``caller_ttft_s``: the caller's, from the call to the first token (set by
            the Ray layer's ``Deployment``; 0 on a rank); prefetch_s: admission to take.
        latency_s: rank 0's clock, from taking it out of its inbox to its result.
        load_s: the longest L2 -> L1 copy of the prefix (it overlaps the prefill);
        load_bytes / prefetch_bytes: bytes copied L2 -> L1 / read from L3 for it.
        queue_s: admission to the start of its prefill (waiting for room and prefetches).
        ttft_split: ``ttft_s`` split into disjoint parts (:class:`TTFTSplit`).
        finish_reason: ``length``, ``stop``, ``abort`` or ``error``.
        error: why the request was refused or failed (nothing else is set then), as
            ``field: problem`` for a bad request.
        error_kind: ``invalid`` (the request itself), ``overloaded`` (refused for now:
            the queue is full) or ``internal`` (it failed while running).
    """

    rid: str
    output_tokens: list[int] = msgspec.field(default_factory=list)
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    recomputed_tokens: int = 0
    ttft_s: float = 0.0
    caller_ttft_s: float = 0.0
    latency_s: float = 0.0
    prefetch_s: float = 0.0
    load_s: float = 0.0
    load_bytes: int = 0
    prefetch_bytes: int = 0
    queue_s: float = 0.0
    ttft_split: TTFTSplit = msgspec.field(default_factory=TTFTSplit)
    finish_reason: FinishReason = FinishReason.LENGTH
    error: str | None = None
    error_kind: ErrorKind | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from L1, L2 or L3 (OpenAI's ``cached_tokens``)."""
        return self.device_hit_tokens + self.host_hit_tokens


class StepOutput(msgspec.Struct):
    """What one step produced: finished requests, and the tokens each running request
    generated in it (in order; what a streaming caller forwards)."""

    results: list[RequestResult] = msgspec.field(default_factory=list)
    tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)


class StreamChunk(msgspec.Struct):
    """A piece of a streamed request: tokens generated since the last chunk; the last
    chunk carries the request's result (its ``output_tokens`` are all of them)."""

    tokens: list[int]
    result: RequestResult | None = None


class RequestError(HiCacheError, ValueError):
    """A request that cannot be run; ``field`` names what was wrong."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self) -> tuple[type[RequestError], tuple[str, str]]:
        return type(self), (self.field, self.problem)


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _token_ids(tokens: object) -> list[int]:
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise RequestError(
                "tokens", f"a numpy array must be 1-D of integers, got {tokens.dtype}{tokens.shape}"
            )
        out: list[int] = tokens.tolist()
        return out
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise RequestError(
                "tokens",
                f"a tensor must be 1-D of integers, got {tokens.dtype}{tuple(tokens.shape)}",
            )
        if tokens.dtype == torch.bool:
            raise RequestError("tokens", "a tensor of bools is not token ids")
        out = tokens.tolist()
        return out
    if not isinstance(tokens, (list, tuple)):
        raise RequestError("tokens", f"expected a list of int, got {type(tokens).__name__}")
    if all(type(t) is int for t in tokens):
        return list(tokens)
    converted = []
    for i, t in enumerate(tokens):
        if type(t) is int:
            converted.append(t)
        elif isinstance(t, np.integer):
            converted.append(int(t))
        else:
            raise RequestError(
                "tokens", f"element {i} is {type(t).__name__} {_describe(t)}, expected int"
            )
    return converted


def check_request(request: object) -> GenerateRequest:
    """``request`` with exactly the right types (token ids as a list of ``int``).

    Raises:
        RequestError: naming the field and the problem.
    """
    if not isinstance(request, GenerateRequest):
        raise RequestError("request", f"expected a GenerateRequest, got {type(request).__name__}")
    rid = request.rid
    if type(rid) is not str:
        raise RequestError("rid", f"expected a str, got {type(rid).__name__} {_describe(rid)}")
    if not 0 < len(rid) <= MAX_RID_CHARS:
        raise RequestError("rid", f"must have 1 to {MAX_RID_CHARS} characters, got {len(rid)}")
    tokens = _token_ids(request.tokens)
    if not tokens:
        raise RequestError("tokens", "empty prompt")
    low, high = min(tokens), max(tokens)
    if low < 0 or high > MAX_TOKEN_ID:
        raise RequestError("tokens", f"token id {low if low < 0 else high} is out of range")
    max_new = request.max_new_tokens
    if type(max_new) is not int and not isinstance(max_new, np.integer):
        raise RequestError(
            "max_new_tokens", f"expected an int, got {type(max_new).__name__} {_describe(max_new)}"
        )
    max_new = int(max_new)
    if not 0 <= max_new <= MAX_NEW_TOKENS:
        raise RequestError("max_new_tokens", f"{max_new} is outside [0, {MAX_NEW_TOKENS}]")
    salt = request.cache_salt
    if type(salt) is not str:
        raise RequestError(
            "cache_salt", f"expected a str, got {type(salt).__name__} {_describe(salt)}"
        )
    if len(salt) > MAX_SALT_CHARS:
        raise RequestError("cache_salt", f"has {len(salt)} characters, at most {MAX_SALT_CHARS}")
    return GenerateRequest(rid, tokens, max_new, _check_sampling(request.sampling), salt)


def _check_sampling(params: object) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise RequestError("sampling", f"expected SamplingParams, got {type(params).__name__}")
    try:
        msgspec.convert(msgspec.structs.asdict(params), SamplingParams, strict=True)
    except msgspec.ValidationError as exc:
        raise RequestError("sampling", str(exc)) from None
    p = params
    if not 0 <= p.temperature <= 100:  # NaN fails too
        raise RequestError("sampling.temperature", f"{p.temperature} is outside [0, 100]")
    if not 0 < p.top_p <= 1:
        raise RequestError("sampling.top_p", f"{p.top_p} is outside (0, 1]")
    if not 0 <= p.top_k <= 1 << 20:
        raise RequestError("sampling.top_k", f"{p.top_k} is outside [0, 2**20]")
    if p.seed is not None and not 0 <= p.seed < 1 << 63:
        raise RequestError("sampling.seed", f"{p.seed} is outside [0, 2**63)")
    if any(not 0 <= t <= MAX_TOKEN_ID for t in p.stop_token_ids):
        raise RequestError("sampling.stop_token_ids", "a token id is out of range")
    return p


def check_limits(
    request: GenerateRequest, vocab_size: int, capacity_tokens: int, max_context: int = 0
) -> None:
    """Refuse a (type-checked) request the model or the device pool can never serve.

    Raises:
        RequestError: a token id outside the vocabulary, more tokens than the model's
            context (``max_context``, 0: unbounded) or than the device pool holds.
    """
    high = max(request.tokens)
    if high >= vocab_size:
        raise RequestError("tokens", f"token id {high} is outside the vocabulary [0, {vocab_size})")
    stops = request.sampling.stop_token_ids
    if stops and max(stops) >= vocab_size:
        raise RequestError("sampling.stop_token_ids", f"a token id is outside [0, {vocab_size})")
    total = len(request.tokens) + request.max_new_tokens
    if max_context and total > max_context:
        raise RequestError(
            "tokens",
            f"prompt plus max_new_tokens is {total} tokens, more than the model's context of "
            f"{max_context}",
        )
    if total > capacity_tokens:
        raise RequestError(
            "tokens",
            f"prompt plus max_new_tokens is {total} tokens, which can never fit the device "
            f"pool ({capacity_tokens} tokens)",
        )


def error_result(request: object, error: str, kind: ErrorKind = ErrorKind.INVALID) -> RequestResult:
    """An error result for ``request`` (whatever it is)."""
    rid = getattr(request, "rid", "")
    return failed_result(rid if type(rid) is str else "", error, kind)


def failed_result(rid: str, error: str, kind: ErrorKind = ErrorKind.INVALID) -> RequestResult:
    """An error result for the request ``rid``."""
    return RequestResult(rid=rid, error=error, finish_reason=FinishReason.ERROR, error_kind=kind)


def check_batch(requests: object) -> Sequence[object]:
    """The sequence of requests of one call; raises ``TypeError`` for anything else."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise TypeError(f"expected a sequence of GenerateRequest, got {type(requests).__name__}")
    return requests
