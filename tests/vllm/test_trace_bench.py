"""``bench trace --engine vllm``: a small trace of conversations through two vLLM replicas on
Ray Serve LLM (the cache router, the connector on one ray store) and through two without
reuse; no request fails, the answers equal a plain vLLM engine's, the cluster reports the
cached prompt tokens vLLM saw, and a bad model is refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.bench.trace_bench import run_trace_bench
from apps.bench.trace_options import TraceOptions
from hicache_ray.base.errors import ConfigError

pytest.importorskip("ray.serve.llm")


def _trace(path: Path) -> Path:
    """Three conversations of three turns (each turn's prompt holds the last one's), a
    512-token trace block each: 32 tokens once scaled to vLLM's blocks."""
    lines = []
    for turn in range(3):
        for conv in range(3):
            blocks = [100 * conv + b for b in range(turn + 2)]
            lines.append(
                {
                    "timestamp": 1000 * (3 * turn + conv),
                    "input_length": 512 * len(blocks) - 200,
                    "output_length": 64,
                    "hash_ids": blocks,
                }
            )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_trace_through_vllm_replicas(checkpoint: Path, tmp_path: Path) -> None:
    from tests.helpers import ensure_local_ray

    ensure_local_ray()
    opts = TraceOptions(
        engine="vllm",
        model=str(checkpoint),
        trace=str(_trace(tmp_path / "trace.jsonl")),
        modes=("none", "l1_l2_l3"),
        replicas=2,
        clients=2,
        overload=False,
        check=3,
        device_tokens=1024,
    )
    lines: list[str] = []
    figures = {f.name: f.value for f in run_trace_bench(opts, lines.append)}
    for mode in ("none", "l1_l2_l3"):
        assert figures[f"trace.{mode}.failed_requests"] == 0
        assert figures[f"trace.{mode}.ttft_p50_ms"] > 0
    assert figures["trace.none.hit_tokens"] == 0  # no prefix cache, no connector
    # the later turns' histories, cached on their replica or loaded from L3
    assert 0 < figures["trace.l1_l2_l3.hit_tokens"] <= figures["trace.ideal.hit_tokens"]
    assert figures["trace.wrong_outputs"] == 0
    assert figures["trace.checked_outputs"] == 6  # 3 requests x 2 modes


def test_vllm_runs_a_checkpoint_not_a_preset() -> None:
    with pytest.raises(ConfigError, match="checkpoint directory"):
        run_trace_bench(TraceOptions(engine="vllm", model="tiny4"), print)
