"""Chained SHA-256 page hashes: the name of a page's tokens, the same in every process.

Page ``k`` hashes the raw 32-byte digest of page ``k - 1`` followed by its token ids as
uint32 little-endian bytes; page 0 hashes its tokens alone. That is SGLang's page hash, so
pages are addressed the way the reference system addresses them (the test vectors of
docs/storage.md, "Page hash", hold).

NOTE: the chain's seed is the only input besides the tokens. With no tenant salt there is
no seed; with one, page 0 also hashes the 32-byte seed
``SHA-256(b"sglang-cache-namespace-v1" + b"\x00" + b"\x01" + len(salt) as 8 bytes LE +
salt)``, which is SGLang's ``storage_namespace_seed(extra_key=None, cache_salt=salt)``: a
tenant salt here is SGLang's ``cache_salt``, and both engines name the same pages alike.
Two tenants' keys are disjoint. Model identity is deliberately *not* in the seed: it lives
in the key's namespace digest, which is what lets a rank reject a foreign page by its
header. Nothing here depends on ``PYTHONHASHSEED``, the process or the host.

Only whole pages are hashed: a partial last page is never stored.
"""

from __future__ import annotations

import hashlib

from hicache_ray.base.tokens import TOKEN_BYTES, TokenIds, encode_tokens

__all__ = ["page_hashes", "salt_seed"]

_SEED_DOMAIN = b"sglang-cache-namespace-v1"


def salt_seed(salt: str | bytes | None) -> bytes:
    """The 32-byte chain seed of a tenant salt (see the module docstring); empty for none."""
    if not salt:
        return b""
    raw = salt.encode() if isinstance(salt, str) else salt
    h = hashlib.sha256(_SEED_DOMAIN)
    h.update(b"\x00")  # no extra_key
    h.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    return h.digest()


def page_hashes(
    tokens: TokenIds,
    page_size: int,
    *,
    salt: str | bytes | None = None,
    prior: bytes = b"",
) -> list[str]:
    """Hex page hashes of every whole page of ``tokens``.

    Args:
        tokens: token ids (a list, array, tensor, or already-encoded key bytes).
        page_size: tokens per page.
        salt: optional tenant salt (see the module docstring).
        prior: raw digest of the page before ``tokens`` to continue a chain; when set,
            ``salt`` is ignored (it is already in the chain).

    Returns:
        One 64-character hex digest per whole page; a partial last page gets none.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    key = encode_tokens(tokens)
    step = page_size * TOKEN_BYTES
    previous = prior or salt_seed(salt)
    out: list[str] = []
    sha256 = hashlib.sha256
    for start in range(0, len(key) - step + 1, step):
        h = sha256(previous)
        h.update(key[start : start + step])
        previous = h.digest()
        out.append(previous.hex())
    return out
