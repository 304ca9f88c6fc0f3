"""Real write errors of the file backend: a full disk mid-write, permission denied, and an
S3 error; each ends the batch cleanly (counted, no exception, no partial object)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from hicache_ray.storage import FileObjects, PagedBackend

from .conftest import empty_buffers, make_pages, make_plan, page_keys


class _FailingStream:
    def __init__(self, inner: Any, error: OSError, fail_on: int) -> None:
        self.inner, self.error, self.fail_on, self.writes = inner, error, fail_on, 0

    def write(self, data: Any) -> int:
        self.writes += 1
        if self.writes == self.fail_on:
            raise self.error
        return int(self.inner.write(data))

    def __enter__(self) -> _FailingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()


class _FailingFS:
    """A local filesystem whose ``fail_at``-th output stream fails on its ``fail_on``-th write."""

    def __init__(self, inner: Any, error: OSError, fail_at: int, fail_on: int) -> None:
        self.inner, self.error, self.fail_at, self.fail_on, self.opened = (
            inner, error, fail_at, fail_on, 0
        )  # fmt: skip

    def open_output_stream(self, path: str) -> Any:
        self.opened += 1
        stream = self.inner.open_output_stream(path)
        if self.opened == self.fail_at:
            return _FailingStream(stream, self.error, self.fail_on)
        return stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize(
    ("error", "fail_on"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), 2),  # header written, payload not
        (PermissionError(errno.EACCES, "Permission denied"), 1),
    ],
)
def test_a_local_write_error_ends_the_batch_without_a_partial_object(
    tmp_path: Path, error: OSError, fail_on: int
) -> None:
    objects = FileObjects(str(tmp_path))
    objects.fs = _FailingFS(objects.fs, error, fail_at=3, fail_on=fail_on)  # type: ignore[assignment]
    plan = make_plan()
    backend = PagedBackend("file", objects, plan, scan_on_start=False)
    keys, pages = page_keys(plan, 5), make_pages(plan, 5)
    assert backend.put(keys, pages) == 2  # pages 0 and 1 stored, page 2 failed, none after
    assert backend.stats().put_failures == 1
    assert not list(tmp_path.rglob(".tmp-*"))  # the partial temporary file is gone
    assert objects.size(keys[2]) is None and objects.size(keys[3]) is None
    out = empty_buffers(plan, 5)
    assert backend.get(keys, out) == 2
    backend.check_integrity()
    assert backend.put(keys, pages) == 5  # the next batch (disk freed) stores the rest


def test_an_s3_error_ends_the_batch_and_is_counted(s3_endpoint: str) -> None:
    uri = f"s3://no-such-bucket/p?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1"
    plan = make_plan()
    backend = PagedBackend("file", FileObjects(uri), plan, scan_on_start=False)
    keys = page_keys(plan, 3)
    assert backend.put(keys, make_pages(plan, 3)) == 0  # NoSuchBucket: refused, not raised
    stats = backend.stats()
    assert stats.put_failures == 1 and stats.put_pages == 0
    assert backend.exists(keys) == 0 and backend.get(keys, empty_buffers(plan, 3)) == 0
