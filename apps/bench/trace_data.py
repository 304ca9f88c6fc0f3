"""The request trace ``bench trace`` replays: loading, scaling to token ids, the ideal.

A trace line (Mooncake's FAST'25 format) gives a request's arrival (ms), input and output
lengths in tokens and its prompt's prefix blocks (``hash_ids``, one per ``TRACE_BLOCK``
tokens; equal ids at the same position are the same block of the same prefix). Text is
withheld, so the replay makes it:

- a block id becomes ``block_tokens`` token ids, drawn below the model's vocabulary by a
  generator seeded with ``(seed, block id)``: the same block is the same tokens in every
  request, run and process;
- a prompt is its blocks' tokens, the last block cut to its share of ``input_length``
  (``ceil(share * block_tokens)``, at least 1);
- ``max_tokens`` is ``output_length`` scaled the same way, at least 1.

The ideal is computed from the scaled prompts alone, in trace order: an infinite cache of
whole pages (the ceiling any cache reaches on the trace), and an LRU cache of a given
number of pages (:mod:`apps.multiturn.oracle`). Answers are not inserted: the trace's next
turn holds the real answer's blocks, which a replayed answer never equals.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from apps.multiturn.oracle import OracleRequest, lru_hit_tokens
from hicache_ray.base.errors import ConfigError

__all__ = [
    "DEFAULT_TRACE",
    "TRACE_BLOCK",
    "ScaledRequest",
    "TraceRequest",
    "ideal_hit_tokens",
    "load_trace",
    "scale",
]

TRACE_BLOCK = 512  # tokens per hash id in Mooncake's traces
# The conversation trace, shipped with the package (apps/bench/traces/README.md).
DEFAULT_TRACE = Path(__file__).parent / "traces" / "conversation_trace.jsonl.gz"


@dataclass(frozen=True)
class TraceRequest:
    """One trace line, checked."""

    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScaledRequest:
    """A trace request as the replay sends it."""

    index: int  # its position in the trace
    arrival_s: float  # unscaled: the trace's own clock
    prompt: list[int]
    max_tokens: int


def _check_line(raw: object, where: str) -> TraceRequest:
    """A trace line, or ``ConfigError`` naming the line and what is wrong with it."""
    if not isinstance(raw, dict):
        raise ConfigError("trace", where, "not a JSON object", "one request object per line")
    fields = {}
    for key in ("timestamp", "input_length", "output_length"):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError("trace", where, f"{key} is {value!r}", "a number >= 0")
        fields[key] = value
    ids = raw.get("hash_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise ConfigError("trace", where, "hash_ids is not a list of ints >= 0", "fix the line")
    if fields["input_length"] < 1 or fields["input_length"] > len(ids) * TRACE_BLOCK:
        raise ConfigError(
            "trace",
            where,
            f"input_length {fields['input_length']} does not fit {len(ids)} blocks",
            f"at most {TRACE_BLOCK} tokens per hash id",
        )
    return TraceRequest(
        float(fields["timestamp"]),
        int(fields["input_length"]),
        int(fields["output_length"]),
        tuple(ids),
    )


def load_trace(path: str | Path, limit: int = 0) -> list[TraceRequest]:
    """The first ``limit`` requests (0: all) of a JSONL trace (``.gz`` read as gzip),
    in arrival order.

    Raises:
        ConfigError: the file is missing or a line is not a valid request.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--trace", str(path), "no such file", "give a JSONL trace file")
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[TraceRequest] = []
    with opener(path, "rt") as f:
        for number, line in enumerate(f, 1):
            if limit and len(out) == limit:
                break
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    "trace", f"{path}:{number}", str(e), "one JSON object a line"
                ) from None
            out.append(_check_line(raw, f"{path}:{number}"))
    if not out:
        raise ConfigError("--trace", str(path), "holds no request", "give a non-empty trace")
    out.sort(key=lambda r: r.arrival_ms)  # stable: equal times keep the file's order
    return out


def _block_tokens(block_id: int, block_tokens: int, vocab: int, seed: int) -> list[int]:
    rnd = random.Random(f"{seed}:{block_id}")  # str seeds hash the same in every process
    return [rnd.randrange(vocab) for _ in range(block_tokens)]


def scale(
    trace: list[TraceRequest], block_tokens: int, vocab: int, seed: int = 0
) -> list[ScaledRequest]:
    """The replay's requests: each block ``block_tokens`` deterministic token ids."""
    if block_tokens < 1 or vocab < 2:
        raise ConfigError("--block-tokens", block_tokens, "must be >= 1", "use the page size")
    cache: dict[int, list[int]] = {}
    out = []
    for index, r in enumerate(trace):
        prompt: list[int] = []
        for block in r.hash_ids:
            if block not in cache:
                cache[block] = _block_tokens(block, block_tokens, vocab, seed)
            prompt += cache[block]
        last = r.input_length - TRACE_BLOCK * (len(r.hash_ids) - 1)
        keep = max(1, -(-last * block_tokens // TRACE_BLOCK))
        del prompt[len(prompt) - block_tokens + keep :]
        max_tokens = max(1, round(r.output_length * block_tokens / TRACE_BLOCK))
        out.append(ScaledRequest(index, r.arrival_ms / 1e3, prompt, max_tokens))
    return out


def ideal_hit_tokens(
    requests: list[ScaledRequest], page_size: int, capacity_pages: int | None = None
) -> int:
    """Prompt tokens a cache of whole pages could serve, requests in trace order, one at a
    time: infinite (``capacity_pages`` None) or LRU of that many pages."""
    waves = [[OracleRequest(r.prompt, [])] for r in requests]
    return sum(sum(w) for w in lru_hit_tokens(waves, page_size, capacity_pages))
