"""Page objects as files on any ``pyarrow.fs`` filesystem (local disk, S3, GCS, HDFS).

Layout under the root: ``{root}/{key[:2]}/{key}`` (256 fan-out directories keep listings
short). On a local filesystem a write goes to ``.tmp-{key}-{random}`` beside the target and
is renamed into place, so a reader never opens a half-written page; on object stores a
single PUT is already atomic and a rename would be a copy, so objects are written directly.
Local reads stream the payload straight into the caller's buffer; remote reads fetch the
whole object in one request.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from hicache_ray.storage.objects import ObjectStore, split_object
from hicache_ray.storage.page_format import (
    PREFIX_BYTES,
    CorruptPage,
    header_length,
)

__all__ = ["FileObjects", "open_filesystem"]

TMP_PREFIX = ".tmp-"
HEAD_READ_BYTES = 4096  # frame prefix + header (a few hundred bytes) + payload start


def open_filesystem(root: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and base path of a local directory or URI."""
    if "://" not in root:
        path = os.path.abspath(root)
        os.makedirs(path, exist_ok=True)
        return pafs.LocalFileSystem(), path
    fs, path = pafs.FileSystem.from_uri(root)
    return fs, path.rstrip("/")


class FileObjects(ObjectStore):
    def __init__(self, root: str) -> None:
        self.fs, self.base = open_filesystem(root)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self._made_dirs: set[str] = set()  # fan-out dirs known to exist; set.add is atomic

    def _dir(self, key: str) -> str:
        return f"{self.base}/{key[:2]}"

    def _path(self, key: str) -> str:
        return f"{self.base}/{key[:2]}/{key}"

    def write(self, key: str, header: bytes, payload: memoryview) -> None:
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

    def read(self, key: str, out: memoryview) -> tuple[bytes, str | None] | None:
        try:
            if not self.local:
                with self.fs.open_input_file(self._path(key)) as f:
                    return split_object(f.read(), out)
            with self.fs.open_input_file(self._path(key)) as f:
                return self._read_local(f, out)
        except FileNotFoundError:
            return None

    @staticmethod
    def _read_local(f: pa.NativeFile, out: memoryview) -> tuple[bytes, None]:
        # NOTE: not hashed here: the backend hashes this payload on its helper thread
        # while this thread reads the next object (hashing inline cost ~20 % of reads).
        # The frame, header and payload start come in one small read; a payload longer
        # than ``out`` fails the header's payload_bytes check, a shorter one is caught here.
        head = f.read(HEAD_READ_BYTES)
        start = PREFIX_BYTES + header_length(head)
        if len(head) < start:
            raise CorruptPage("object ended inside its header")
        got = min(len(head) - start, out.nbytes)
        out[:got] = head[start : start + got]
        while got < out.nbytes:
            n = f.readinto(out[got:])
            if n <= 0:
                raise CorruptPage("object ended early")  # truncated, or shrank while read
            got += n
        return bytes(head[PREFIX_BYTES:start]), None

    def size(self, key: str) -> int | None:
        info = self.fs.get_file_info(self._path(key))
        return None if info.type != pafs.FileType.File else int(info.size)

    def remove(self, key: str) -> None:
        self._remove_quietly(self._path(key))

    def _remove_quietly(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(path)

    def scan(self) -> Iterator[tuple[str, int, float]]:
        selector = pafs.FileSelector(self.base, recursive=True, allow_not_found=True)
        for info in self.fs.get_file_info(selector):
            if info.type != pafs.FileType.File or info.base_name.startswith(TMP_PREFIX):
                continue
            mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
            yield info.base_name, int(info.size or 0), mtime
