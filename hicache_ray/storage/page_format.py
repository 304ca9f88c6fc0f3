"""The page object: a framed header, then the payload bytes.

::

    offset  size  field
    0       4     magic b"HCRP"
    4       4     header length N (uint32 little-endian)
    8       N     PageHeader, msgpack
    8 + N   ...   payload (the object's KV bytes in namespace object layout)

Readers verify everything before a byte reaches a pool: the frame, the format version, the
namespace digest, the key, dtype and shape against the caller's buffer, the payload length
and an XXH3-128 checksum of the payload (about 20 GB/s here, so it costs little next to
storage I/O; SHA-256 would run at 1 GB/s). Any mismatch raises :class:`CorruptPage`.

NOTE: readers hash the payload in 256 KiB chunks as they land in the caller's buffer, while
each chunk is still in cache: hashing after the whole read costs a second pass over DRAM
(reads ran at 0.7 of raw pyarrow here that way, 0.9 chunked).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, overload

import msgspec
import numpy as np
import torch
import xxhash

from hicache_ray.base.errors import HiCacheError
from hicache_ray.base.layout import DTYPES

__all__ = [
    "FORMAT_VERSION",
    "PREFIX_BYTES",
    "CorruptPage",
    "FutureHeaders",
    "HeaderArgs",
    "LazyHeaders",
    "PageHeader",
    "ReadOut",
    "StridedOut",
    "checksum",
    "checksum_of",
    "copy_hashed",
    "flip_byte",
    "encode_header",
    "framed_size",
    "header_length",
    "int_array",
    "tensor_problem",
    "verify",
    "zero_out",
]

MAGIC = b"HCRP"
FORMAT_VERSION = 1
PREFIX_BYTES = 8
_PREFIX = struct.Struct("<4sI")
_MAX_HEADER_BYTES = 1 << 16
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CorruptPage(HiCacheError):
    """A stored page failed verification; it must be treated as a miss and dropped."""


class PageHeader(msgspec.Struct, frozen=True, kw_only=True):
    format_version: int
    namespace: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    payload_bytes: int
    checksum: str


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PageHeader)


CHUNK_BYTES = 512 * 1024


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class StridedOut:
    """A read's destination that is not contiguous: an object's place in a buffer laid out
    otherwise (a page of an SGLang host pool). A read copies the payload, in object order,
    into it in one strided pass and hashes the payload it copied from, so nothing is
    staged; stores use it only for payloads that cannot change while read (objects in
    memory or in the Ray object store)."""

    __slots__ = ("array", "nbytes")

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(f"a read lands in host memory, not on {tensor.device}")
        self.array: np.ndarray = int_array(tensor)
        self.nbytes: int = self.array.nbytes

    @classmethod
    def of_array(cls, array: np.ndarray) -> StridedOut:
        """Over ``array`` (a row of :func:`int_array`: about 0.3 us, a tensor's view 3 us)."""
        out = cls.__new__(cls)
        out.array, out.nbytes = array, array.nbytes
        return out

    def fill(self, src: memoryview | bytes | np.ndarray) -> str:
        """Copy ``src`` (a payload, or a contiguous 1-D uint8 array of one) in (numpy copies
        without the GIL); the checksum of ``src``."""
        array = self.array
        if isinstance(src, np.ndarray):  # a view of it: a third of frombuffer's cost
            np.copyto(array, src.view(array.dtype).reshape(array.shape))
            return checksum(src.data)
        np.copyto(array, np.frombuffer(src, dtype=array.dtype).reshape(array.shape))
        return checksum(src)

    def contents(self) -> bytes:
        """What it holds, in object order."""
        return np.ascontiguousarray(self.array).tobytes()


ReadOut = memoryview | StridedOut


def int_array(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s bytes as a numpy array of integers of its element size (numpy has no
    bfloat16), sharing its memory."""
    return tensor.view(_INTS[tensor.element_size()]).numpy()


def zero_out(out: ReadOut) -> None:
    """Zero-fill a read's destination."""
    if isinstance(out, StridedOut):
        out.array[...] = 0
    else:
        np.frombuffer(out, dtype=np.uint8)[:] = 0


def checksum(payload: memoryview | bytes) -> str:
    return xxhash.xxh3_128_hexdigest(payload)


def checksum_of(out: ReadOut) -> str:
    """The checksum of what a read destination holds."""
    return checksum(out.contents() if isinstance(out, StridedOut) else out)


def flip_byte(out: ReadOut) -> None:
    """Corrupt one byte in the middle of ``out`` (fault injection: a medium's bit rot)."""
    if isinstance(out, StridedOut):
        out.array[np.unravel_index(out.array.size // 2, out.array.shape)] ^= 0x5A
    else:
        out[out.nbytes // 2] ^= 0xFF


def copy_hashed(src: memoryview | np.ndarray, out: ReadOut) -> str:
    """Copy ``src`` (or a contiguous 1-D uint8 array) into ``out`` (same size) chunk by
    chunk; the checksum of the copy."""
    if isinstance(out, StridedOut):
        return out.fill(src)
    h = xxhash.xxh3_128()
    # numpy copies without the GIL (a memoryview slice assignment holds it), so reads on
    # several threads copy in parallel.
    source = np.frombuffer(src, dtype=np.uint8)
    target = np.frombuffer(out, dtype=np.uint8)
    for start in range(0, out.nbytes, CHUNK_BYTES):
        chunk = target[start : start + CHUNK_BYTES]
        np.copyto(chunk, source[start : start + CHUNK_BYTES])
        h.update(chunk.data)
    return h.hexdigest()


def encode_header(
    key: str, namespace: str, page: torch.Tensor, payload: memoryview, digest: str | None = None
) -> bytes:
    """The frame prefix and header of ``page`` (its payload goes after, unchanged); the
    payload's checksum is computed unless given as ``digest``."""
    header = PageHeader(
        format_version=FORMAT_VERSION,
        namespace=namespace,
        key=key,
        dtype=_DTYPE_NAMES[page.dtype],
        shape=tuple(page.shape),
        payload_bytes=payload.nbytes,
        checksum=checksum(payload) if digest is None else digest,
    )
    body = _encoder.encode(header)
    return _PREFIX.pack(MAGIC, len(body)) + body


_CHECKSUM_CHARS = 32  # XXH3-128 in hex


def framed_size(key: str, namespace: str, page: torch.Tensor, payload: memoryview) -> int:
    """Bytes of the object ``encode_header`` + payload make, without hashing the payload
    (a checksum is always 32 hex characters)."""
    return len(encode_header(key, namespace, page, payload, "0" * _CHECKSUM_CHARS)) + payload.nbytes


def header_length(prefix: bytes | memoryview) -> int:
    """The header length from a frame's 8-byte prefix (``prefix``: it, or the frame)."""
    if len(prefix) < PREFIX_BYTES:
        raise CorruptPage(f"object shorter than its {PREFIX_BYTES}-byte frame prefix")
    magic, length = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptPage(f"bad magic {magic!r}")
    if length > _MAX_HEADER_BYTES:
        raise CorruptPage(f"header length {length} is implausible")
    return int(length)


def verify(
    header_bytes: bytes | memoryview,
    key: str,
    namespace: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    digest: str,
) -> None:
    """Check a header against a payload of ``dtype`` and ``shape`` read for ``key``, whose
    checksum is ``digest``.

    Raises:
        CorruptPage: naming the first check that failed.
    """
    try:
        header = _decoder.decode(header_bytes)
    except msgspec.DecodeError as exc:
        raise CorruptPage(f"unreadable header: {exc}") from None
    if header.format_version != FORMAT_VERSION:
        raise CorruptPage(f"format version {header.format_version}, expected {FORMAT_VERSION}")
    if header.namespace != namespace:
        raise CorruptPage(f"namespace {header.namespace}, expected {namespace}")
    if header.key != key:
        raise CorruptPage(f"header names key {header.key!r}")
    name = _DTYPE_NAMES.get(dtype)
    if header.dtype != name or header.shape != shape:
        raise CorruptPage(f"holds {header.dtype}{list(header.shape)}, expected {name}{list(shape)}")
    nbytes = math.prod(shape) * dtype.itemsize
    if header.payload_bytes != nbytes:
        raise CorruptPage(f"payload of {header.payload_bytes} bytes, expected {nbytes}")
    if digest != header.checksum:
        raise CorruptPage("payload checksum mismatch")


def tensor_problem(
    t: object, dtype: torch.dtype, shape: tuple[int, ...], *, contiguous: bool
) -> str | None:
    """What is wrong with ``t`` as a page (or a buffer for one) of ``dtype`` and ``shape``
    in host memory; None if nothing."""
    if not isinstance(t, torch.Tensor):
        return f"expected a tensor, got {type(t).__name__}"
    if t.dtype != dtype or tuple(t.shape) != shape:
        return f"expected {dtype}{list(shape)}, got {t.dtype}{list(t.shape)}"
    if t.device.type != "cpu":
        return f"expected a CPU tensor, got one on {t.device}"
    if contiguous and not t.is_contiguous():
        return "expected a contiguous tensor, got a strided view"
    return None


HeaderArgs = tuple[str, str, torch.Tensor, memoryview, "str | None"]


class _Headers(Sequence[bytes]):
    """Headers a store reads one by one as it writes; a slice is another of the kind."""

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def _header(self, i: int) -> bytes:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(i, slice):
            return type(self)(self._items[i])
        return self._header(i)


class LazyHeaders(_Headers):
    """Headers made on the writing thread when the store first asks for each (as it
    assembles the object holding the page), so the payload is hashed just before the write
    copies it, while its bytes are still in cache. Items: :func:`encode_header`'s args."""

    def __init__(self, items: Sequence[HeaderArgs]) -> None:
        super().__init__(items)
        self._made: dict[int, bytes] = {}

    def _header(self, i: int) -> bytes:
        made = self._made.get(i)
        if made is None:
            made = self._made[i] = encode_header(*self._items[i])
        return made


class FutureHeaders(_Headers):
    """Headers made on a helper thread, waited for one by one as the store writes them,
    so hashing page i + 1 overlaps writing page i. Items: their futures."""

    def _header(self, i: int) -> bytes:
        result: bytes = self._items[i].result()
        return result

    def cancel(self) -> None:
        """Drop the headers not started yet (the write ended before needing them)."""
        for future in self._items:
            future.cancel()
