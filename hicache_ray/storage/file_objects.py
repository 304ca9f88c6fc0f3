"""Page objects as files on any ``pyarrow.fs`` filesystem (local disk, S3, GCS, HDFS).

Layout under the root: ``{root}/{key[:2]}/{key}`` (256 fan-out directories keep listings
short). Keys are checked against the key grammar before they get here (no ``/``, no
``..``), so a path never leaves the root. On a local filesystem a write goes to
``.tmp-{key}-{random}`` beside the target and is renamed into place, so a reader never
opens a half-written page; on object stores a single PUT is already atomic and a rename
would be a copy, so objects are written directly. Local reads stream the payload straight
into the caller's buffer; remote reads fetch the whole object in one request.

Threading: ``read_many`` reads ``READ_AHEAD`` objects at once on this store's reader
threads, each hashing what it read while it is still in cache, and returns them in key
order, stopping at the first that is absent or fails; it returns only once no reader
touches the caller's buffers. S3 requests are not retried and time out after
``timeout_s``, so a batch against an unreachable endpoint fails within about one timeout.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from hicache_ray.storage.objects import (
    ObjectStore,
    PageCheck,
    ReadOutcome,
    SizeOutcome,
    split_object,
)
from hicache_ray.storage.page_format import (
    PREFIX_BYTES,
    CorruptPage,
    ReadOut,
    StridedOut,
    checksum,
    header_length,
)

__all__ = ["FileObjects", "open_filesystem"]

TMP_PREFIX = ".tmp-"
HEAD_READ_BYTES = 4096  # frame prefix + header (a few hundred bytes) + payload start
READ_AHEAD = 2  # objects one read_many reads at once


def open_filesystem(root: str, timeout_s: float = 5.0) -> tuple[pafs.FileSystem, str]:
    """The filesystem and base path of a local directory or URI (S3 with ``timeout_s``
    request and connect timeouts and no retries)."""
    if "://" not in root:
        path = os.path.abspath(root)
        os.makedirs(path, exist_ok=True)
        return pafs.LocalFileSystem(), path
    fs, path = pafs.FileSystem.from_uri(root)
    if isinstance(fs, pafs.S3FileSystem):
        options: dict[str, Any] = fs.__reduce__()[1][0]  # the URI's options, as kwargs
        options.update(
            connect_timeout=timeout_s,
            request_timeout=timeout_s,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
        )
        fs = pafs.S3FileSystem(**options)
    return fs, path.rstrip("/")


class FileObjects(ObjectStore):
    def __init__(self, root: str, timeout_s: float = 5.0) -> None:
        self.fs, self.base = open_filesystem(root, timeout_s)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self._made_dirs: set[str] = set()  # fan-out dirs known to exist; set.add is atomic
        self._readers = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="hicache-file-read")

    def _dir(self, key: str) -> str:
        return f"{self.base}/{key[:2]}"

    def _path(self, key: str) -> str:
        return f"{self.base}/{key[:2]}/{key}"

    # ----------------------------------------------------------------- batches

    def size_many(self, keys: Sequence[str], leading: bool = True) -> list[SizeOutcome]:
        out: list[SizeOutcome] = []
        for key in keys:
            try:
                info = self.fs.get_file_info(self._path(key))
            except Exception as exc:
                out.append(exc)
                break
            out.append(int(info.size) if info.type == pafs.FileType.File else None)
            if out[-1] is None and leading:
                break
        return out

    def read_many(
        self, keys: Sequence[str], outs: Sequence[ReadOut], check: PageCheck | None = None
    ) -> list[ReadOutcome]:
        jobs = iter(zip(keys, outs, strict=True))
        running: deque[Future[ReadOutcome]] = deque()

        def submit_next() -> None:
            job = next(jobs, None)
            if job is not None:
                running.append(self._readers.submit(self._read_one, *job))

        found: list[ReadOutcome] = []
        try:
            for _ in range(READ_AHEAD):
                submit_next()
            while running:
                found.append(running.popleft().result())
                if not isinstance(found[-1], tuple):
                    break
                submit_next()
            return found
        finally:
            for read in running:
                if not read.cancel():
                    read.exception()  # wait: the reader may still be writing its buffer

    def write_many(
        self, keys: Sequence[str], headers: Sequence[bytes], payloads: Sequence[memoryview]
    ) -> list[Exception | None]:
        errors: list[Exception | None] = []
        for key, header, payload in zip(keys, headers, payloads, strict=True):
            try:
                self._write(key, header, payload)
            except Exception as exc:
                errors.append(exc)
                break
            errors.append(None)
        return errors

    def remove_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._remove_quietly(self._path(key))

    def scan(self) -> Iterator[tuple[str, int, float]]:
        selector = pafs.FileSelector(self.base, recursive=True, allow_not_found=True)
        for info in self.fs.get_file_info(selector):
            if info.type != pafs.FileType.File or info.base_name.startswith(TMP_PREFIX):
                continue
            mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
            yield info.base_name, int(info.size or 0), mtime

    def close(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)

    # ----------------------------------------------------------------- one key

    def _write(self, key: str, header: bytes, payload: memoryview) -> None:
        path = self._path(key)
        if not self.local:
            with self.fs.open_output_stream(path) as out:
                out.write(header)
                out.write(payload)
            return
        folder = self._dir(key)
        if folder not in self._made_dirs:
            self.fs.create_dir(folder, recursive=True)
            self._made_dirs.add(folder)
        tmp = f"{folder}/{TMP_PREFIX}{key}-{uuid.uuid4().hex[:8]}"
        try:
            with self.fs.open_output_stream(tmp) as out:
                out.write(header)
                out.write(payload)
            self.fs.move(tmp, path)
        except BaseException:
            self._remove_quietly(tmp)
            raise

    def _read_one(self, key: str, out: ReadOut) -> ReadOutcome:
        """On a reader thread: one object into ``out``, hashed while still in cache (a
        strided ``out`` gets the object read whole, then copied in)."""
        try:
            if not self.local or isinstance(out, StridedOut):
                with self.fs.open_input_file(self._path(key)) as f:
                    return split_object(f.read(), out)
            with self.fs.open_input_file(self._path(key)) as f:
                header = self._read_local(f, out)
            return header, checksum(out)
        except FileNotFoundError:
            return None
        except Exception as exc:  # CorruptPage, or an I/O error
            return exc

    @staticmethod
    def _read_local(f: pa.NativeFile, out: memoryview) -> bytes:
        # The frame, header and payload start come in one small read; a payload shorter
        # or longer than ``out`` is corrupt (the header's payload_bytes is checked too).
        head = f.read(HEAD_READ_BYTES)
        start = PREFIX_BYTES + header_length(head)
        if len(head) < start:
            raise CorruptPage("object ended inside its header")
        got = min(len(head) - start, out.nbytes)
        out[:got] = head[start : start + got]
        if len(head) - start > out.nbytes:
            raise CorruptPage("object longer than its payload")
        while got < out.nbytes:
            n = f.readinto(out[got:])
            if n <= 0:
                raise CorruptPage("object ended early")  # truncated, or shrank while read
            got += n
        if f.read(1):
            raise CorruptPage("object longer than its payload")
        return bytes(head[PREFIX_BYTES:start])

    def _remove_quietly(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(path)
