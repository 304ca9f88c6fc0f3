"""Real write errors of the file backend: a full disk mid-write, permission denied, and an
S3 error; each ends the batch cleanly (counted, no exception, no partial object)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from hicache_ray.storage import FileObjects, PagedBackend
from tests.storage.conftest import empty_buffers, make_pages, make_plan, page_keys, stored_size


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
    assert stored_size(objects, keys[2]) is None and stored_size(objects, keys[3]) is None
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


@pytest.fixture
def dead_endpoint(request: pytest.FixtureRequest) -> Any:
    """An S3 endpoint that refuses connections ("closed") or accepts them and never
    answers ("silent")."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if request.param == "closed":
        sock.close()
    else:
        sock.listen(512)  # the kernel completes handshakes; nobody ever reads or answers
    yield f"127.0.0.1:{port}"
    sock.close()


@pytest.mark.parametrize("dead_endpoint", ["closed", "silent"], indirect=True)
def test_a_dead_s3_endpoint_fails_each_batch_within_one_timeout(dead_endpoint: str) -> None:
    import time

    uri = f"s3://pages/p?endpoint_override={dead_endpoint}&scheme=http&region=us-east-1"
    timeout_s = 1.0
    plan = make_plan()
    backend = PagedBackend("file", FileObjects(uri, timeout_s), plan, scan_on_start=False)
    keys, pages = page_keys(plan, 128), make_pages(plan, 128)
    for name, call in (
        ("put", lambda: backend.put(keys, pages)),
        ("get", lambda: backend.get(keys, empty_buffers(plan, 128))),
        ("exists", lambda: backend.exists(keys)),
    ):
        started = time.monotonic()
        assert call() == 0, name
        # one request's timeout (plus the connect timeout) whatever the batch size: far
        # below one timeout per page (128 s), with room for a loaded machine
        assert time.monotonic() - started < 20 * timeout_s, name
    stats = backend.stats()
    assert stats.put_failures == 1 and stats.get_failures == 2


@pytest.mark.parametrize(
    "key", ["../../victim", "../../../victim", "a" * 64 + "/../../../victim", "/victim"]
)
def test_no_crafted_key_reaches_outside_the_root(tmp_path: Path, key: str) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    root = tmp_path / "a" / "b" / "store"
    plan = make_plan()
    backend = PagedBackend("file", FileObjects(str(root)), plan, scan_on_start=False)
    for call in (
        lambda: backend.exists([key]),
        lambda: backend.get([key], empty_buffers(plan, 1)),
        lambda: backend.put([key], make_pages(plan, 1)),
        lambda: backend.delete([key]),
    ):
        with pytest.raises(ValueError, match="key"):
            call()
    assert victim.read_bytes() == b"precious"
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p != victim]
