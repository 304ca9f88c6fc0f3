"""Every code block of README.md and docs/ runs as written on this machine, and the
generated parts of docs/ are up to date.

A fenced block tagged ``bash`` or ``python`` runs (bash from the repository root with the
environment's commands on PATH; python in a fresh interpreter). What a bash block writes
under ``/tmp/`` goes to the test's own folder instead: a run leaves nothing there and never
overwrites a user's file. A block that cannot run on a CPU machine (a server that runs
until stopped, a GPU, a cluster) has a ``<!-- not run: why -->`` comment on the line above
it. Untagged blocks are diagrams and schemas.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from apps.docs_gen import regenerate

REPO = Path(__file__).resolve().parents[2]
FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def _blocks() -> list[tuple[str, str, str, str]]:
    """(id, language, code, why not run or '') of every tagged block."""
    out = []
    for path in FILES:
        text = path.read_text()
        for found in _FENCE.finditer(text):
            lang = found[1]
            if lang not in ("bash", "python"):
                assert lang in ("", "text"), f"{path.name}: a block tagged {lang!r}"
                continue
            before = text[: found.start()].rstrip().splitlines()[-1:] or [""]
            skip = re.fullmatch(r"<!-- not run[^:]*: (.+) -->", before[0].strip())
            line = text[: found.start()].count("\n") + 1
            out.append((f"{path.name}:{line}", lang, found[2], skip[1] if skip else ""))
    return out


BLOCKS = _blocks()


def test_there_are_blocks_and_every_skip_says_why() -> None:
    assert len(BLOCKS) >= 10
    assert all(len(why) > 10 for _, _, _, why in BLOCKS if why)
    assert sum(not why for _, _, _, why in BLOCKS) >= 6  # most of them run


@pytest.mark.parametrize(("where", "lang", "code", "why"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_code_block_runs(where: str, lang: str, code: str, why: str, tmp_path: Path) -> None:
    if why:
        pytest.skip(why)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PYTHONPATH": str(REPO),
    }
    writes_tmp = lang == "bash" and " /tmp/" in code
    if writes_tmp:
        code = code.replace(" /tmp/", f" {tmp_path}/")
    argv = (
        ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    )
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{where}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert not writes_tmp or any(tmp_path.iterdir()), f"{where} wrote nothing to {tmp_path}"


def test_generated_docs_are_current() -> None:
    assert regenerate(check=True) == [], "run `make docs` (python -m apps.docs_gen)"
