"""What killed engines leave in /dev/shm: a segment or semaphore that appeared during the
run and that no live process maps or holds open is removed; one in use, one that was
there before, and files of other kinds are left (a folder stands in for /dev/shm)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

from apps.bench.shm_orphans import in_use, remove_orphans, shm_names


def test_only_new_unused_segments_and_semaphores_are_removed(tmp_path: Path) -> None:
    (tmp_path / "psm_before").write_bytes(b"x")
    before = shm_names(tmp_path)
    for name in ("psm_orphan", "sem.mp-orphan", "psm_open", "psm_mapped", "other_file"):
        (tmp_path / name).write_bytes(b"\0" * mmap.PAGESIZE)
    held = os.open(tmp_path / "psm_open", os.O_RDONLY)
    with open(tmp_path / "psm_mapped", "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)  # the file is closed below; the mapping stays
    try:
        assert {"psm_open", "psm_mapped"} <= in_use(tmp_path)
        assert remove_orphans(before, tmp_path) == ["psm_orphan", "sem.mp-orphan"]
    finally:
        mapped.close()
        os.close(held)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"psm_before", "psm_open", "psm_mapped", "other_file"}


def test_a_bench_process_removes_what_its_engines_left_when_it_exits(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from apps.bench import shm_orphans, vllm_apps\n"
        "shm_orphans.SHM = Path(sys.argv[1])\n"
        "vllm_apps.vllm_env()\n"
        "(shm_orphans.SHM / 'psm_left').write_bytes(b'left by a killed engine')\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
    assert not (tmp_path / "psm_left").exists()
