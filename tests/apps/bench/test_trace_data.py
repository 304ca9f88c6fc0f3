"""bench trace's scaling and ideal, on hand-made traces (no Ray)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apps.bench.trace_bench import sized
from apps.bench.trace_data import DEFAULT_TRACE, ideal_hit_tokens, load_trace, scale
from apps.bench.trace_options import TraceOptions
from hicache_ray.base.errors import ConfigError

# Six requests: two conversations (blocks 1-2-3 then 1-2-3-4; 10-11 then 10-11-12), one
# request that shares only block 1 and one that shares nothing. Lengths in trace tokens.
SIX = [
    {"timestamp": 0, "input_length": 1300, "output_length": 100, "hash_ids": [1, 2, 3]},
    {"timestamp": 5, "input_length": 600, "output_length": 50, "hash_ids": [10, 11]},
    {"timestamp": 9, "input_length": 1800, "output_length": 512, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 12, "input_length": 1100, "output_length": 1, "hash_ids": [10, 11, 12]},
    {"timestamp": 20, "input_length": 700, "output_length": 0, "hash_ids": [1, 20]},
    {"timestamp": 30, "input_length": 512, "output_length": 40, "hash_ids": [30]},
]


def _write(tmp_path: Path, lines: list[object]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_scaling_cuts_the_last_block_and_scales_max_tokens(tmp_path: Path) -> None:
    reqs = scale(load_trace(_write(tmp_path, SIX)), block_tokens=8, vocab=100)
    # 1300 = 2 * 512 + 276: two whole blocks, the last cut to ceil(276 / 512 * 8) = 5
    assert [len(r.prompt) for r in reqs] == [21, 10, 29, 18, 11, 8]
    assert [r.max_tokens for r in reqs] == [2, 1, 8, 1, 1, 1]  # at least 1
    assert all(0 <= t < 100 for r in reqs for t in r.prompt)
    assert reqs[2].prompt[:16] == reqs[0].prompt[:16]  # same blocks, same tokens
    assert reqs[4].prompt[:8] == reqs[0].prompt[:8] and reqs[4].prompt[8:] != reqs[0].prompt[8:11]


def test_scaling_is_deterministic_across_processes(tmp_path: Path) -> None:
    path = _write(tmp_path, SIX)
    here = [r.prompt for r in scale(load_trace(path), 8, 1000, seed=3)]
    code = (
        "import json, sys; from apps.bench.trace_data import load_trace, scale; "
        f"print(json.dumps([r.prompt for r in scale(load_trace({str(path)!r}), 8, 1000, seed=3)]))"
    )
    there = json.loads(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    assert here == there
    assert here != [r.prompt for r in scale(load_trace(path), 8, 1000, seed=4)]


def test_the_ideal_of_six_requests(tmp_path: Path) -> None:
    reqs = scale(load_trace(_write(tmp_path, SIX)), block_tokens=8, vocab=1000)
    # Pages of 8 tokens, whole pages only, the last prompt token always computed:
    # r2 reuses blocks 1-2 (r0 held them whole, then 5 tokens of block 3): 16 tokens;
    # r3 reuses block 10 (r1 held 2 tokens of block 11, no whole page); r4 block 1: 8.
    assert ideal_hit_tokens(reqs, 8) == 16 + 8 + 8
    # An LRU of 3 pages: r1's two pages push out r0's first pages before r2 looks.
    assert ideal_hit_tokens(reqs, 8, capacity_pages=3) < 32


def test_bad_traces_are_refused_with_the_line(tmp_path: Path) -> None:
    for bad, said in [
        ({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp"),
        ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}, "fit"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}, "hash_ids"),
        ([1, 2], "JSON object"),
    ]:
        with pytest.raises(ConfigError, match=said) as err:
            load_trace(_write(tmp_path, [SIX[0], bad]))
        assert "trace.jsonl:2" in str(err.value)
    with pytest.raises(ConfigError, match="no such file"):
        load_trace(tmp_path / "missing.jsonl")


def test_the_shipped_trace_loads_and_sizes_by_the_rule() -> None:
    trace = load_trace(DEFAULT_TRACE, limit=50)
    assert len(trace) == 50 and trace[0].hash_ids[0] == 0
    reqs = scale(trace, 16, 8192)
    opts, line = sized(TraceOptions(), reqs)
    assert opts.device_tokens % 16 == 0 and "a quarter" in line
    longest = max(len(r.prompt) + r.max_tokens for r in reqs)
    assert opts.device_tokens >= 2 * longest
