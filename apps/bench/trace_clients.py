"""The clients of ``bench trace``: a scaled trace sent through the OpenAI endpoint as a
client would (HTTP, streamed, token-id prompts, the official ``openai`` client), and what
each request showed: its first token's time, the gaps between tokens, the cache tiers its
prompt came from (``usage.prompt_tokens_details.hicache``) and its answer.

vLLM (``engine="vllm"``) answers in text of its tokenizer: its clients ask for the token
ids beside it (``return_token_ids``), greedy with end-of-sequence ignored (this library's
engine answers so by default), and read the cached prompt tokens from
``usage.prompt_tokens_details.cached_tokens`` (vLLM reports no tiers).

Closed loop: ``clients`` requests in flight, taken in trace order. Open loop: each request
sent at its trace arrival divided by ``time_scale``, however many are in flight (requests
queue at the server, as at a production peak). Every clock starts when the call is made.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from apps.bench.serve_http_bench import openai_client
from apps.bench.trace_data import ScaledRequest

__all__ = ["SERVED", "Outcome", "new_tokens", "replay"]

SERVED = "bench"  # the model name the clients ask for
TIERS = ("l1", "l2", "l3")


@dataclass
class Outcome:
    """What one request showed its client."""

    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    cached: int = 0  # cached prompt tokens of an engine that reports no tiers (vLLM)
    failed: bool = False

    @property
    def hit_tokens(self) -> int:
        return sum(self.tiers.values()) or self.cached


def new_tokens(chunk: Any, vllm: bool) -> tuple[str, list[int]]:
    """A chunk's text, and its token ids when the engine sends them (vLLM)."""
    text = "".join(c.text for c in chunk.choices)
    if not vllm:
        return text, []
    return text, [
        int(t) for c in chunk.choices for t in (c.model_extra or {}).get("token_ids") or []
    ]


async def _send(client: Any, request: ScaledRequest, vllm: bool) -> Outcome:
    out, text = Outcome(), ""
    start = last = time.perf_counter()
    greedy = {"temperature": 0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    try:
        stream = await client.completions.create(
            model=SERVED,
            prompt=request.prompt,
            max_tokens=request.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            **(greedy if vllm else {}),
        )
        async for chunk in stream:
            piece, ids = new_tokens(chunk, vllm)
            now = time.perf_counter()
            new = len(ids) if vllm else len(piece.split())
            if new:
                if not (out.output if vllm else text):
                    out.ttft_s = now - start
                else:
                    out.itl_s.append((now - last) / new)
                last = now
            text += piece
            out.output += ids
            details = chunk.usage.prompt_tokens_details if chunk.usage is not None else None
            tiers = (details.model_extra or {}).get("hicache", {}) if details else {}
            for tier in TIERS:
                out.tiers[tier] += int(tiers.get(tier, 0))
            out.cached += int(getattr(details, "cached_tokens", 0) or 0) if vllm else 0
        if not vllm:
            out.output = [int(t) for t in text.split()]
        out.failed = len(out.output) != request.max_tokens
    except Exception as e:  # a failed request is counted, never raised: the run goes on
        print(f"trace: request {request.index} failed: {e}", file=sys.stderr)
        out.failed = True
    return out


async def replay(
    url: str,
    requests: list[ScaledRequest],
    clients: int,
    time_scale: float,
    label: str,
    vllm: bool = False,
) -> tuple[list[Outcome], float]:
    """Every request's outcome (trace order) and the wall time from the first call to the
    last answer (``vllm``: the endpoint is vLLM's); a progress line on stderr every 10 %
    of the requests."""
    outcomes: list[Outcome | None] = [None] * len(requests)
    done = 0
    step = max(1, len(requests) // 10)
    async with openai_client(url) as client:

        async def one(i: int) -> None:
            nonlocal done
            outcomes[i] = await _send(client, requests[i], vllm)
            done += 1
            if done % step == 0 or done == len(requests):
                print(f"trace {label}: {done}/{len(requests)}", file=sys.stderr, flush=True)

        started = time.perf_counter()
        if time_scale > 0:
            first = requests[0].arrival_s

            async def at(i: int) -> None:
                due = started + (requests[i].arrival_s - first) / time_scale
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                await one(i)

            await asyncio.gather(*(at(i) for i in range(len(requests))))
        else:
            order = iter(range(len(requests)))

            async def worker() -> None:
                for i in order:
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - started
    return [o if o is not None else Outcome(failed=True) for o in outcomes], wall
