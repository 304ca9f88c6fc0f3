"""Who may call the HTTP door, and whose cache a call uses: API keys, tenants and salts.

A key maps to a tenant. ``hicache-ray serve --api-key KEY`` makes each key a tenant of its
own (named from the key's digest, so its pages outlive a restart); ``--api-keys FILE``
maps keys to named tenants, one ``KEY TENANT`` per line (``#`` starts a comment; several
keys may share a tenant), optionally followed by ``quota=BYTES``: what the tenant may hold
in L3 (suffixes ``k``, ``M``, ``G``, ``T`` with or without ``i``/``iB``). The file is read
again when it changes (checked at most every ``reload_s`` seconds, when a call arrives); a
file that no longer parses keeps the keys in force and says why, without naming a key.

Keys are kept only as SHA-256 digests; a call's key is looked up by its digest, so the
comparison's time does not depend on how much of a key matched.

A call's cache salt (:func:`request_salt`) joins the deployment's salt, the tenant and
the call's own ``cache_salt``; a caller's ``cache_salt`` may not hold control characters,
so it can never spell another tenant's salt, and two tenants never share a page.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hicache_ray.base.errors import ConfigError
from hicache_ray.keys.tenant import owner_of, tenant_salt

__all__ = [
    "MAX_CACHE_SALT_CHARS",
    "ApiKeys",
    "KeySpec",
    "Tenant",
    "check_cache_salt",
    "key_digest",
    "parse_keys_file",
    "request_salt",
    "tenant_owner",
]

log = logging.getLogger(__name__)

MAX_CACHE_SALT_CHARS = 256  # a caller's cache_salt over HTTP
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_SIZE = re.compile(r"(\d+)\s*([kKMGT]?)(i?B?)")
_UNITS = {"": 0, "k": 1, "K": 1, "M": 2, "G": 3, "T": 4}


@dataclass(frozen=True)
class Tenant:
    """A caller of the door: its name (seeds its cache salt) and its L3 quota in bytes
    (0: none)."""

    name: str
    quota_bytes: int = 0


@dataclass(frozen=True)
class KeySpec:
    """What a door is told of its keys: the digests of ``--api-key`` keys and the path of a
    keys file (read by each ingress replica: it must be readable where they run)."""

    digests: tuple[str, ...] = ()
    path: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.digests or self.path)


def key_digest(key: str) -> str:
    """The hex SHA-256 of an API key: how keys are kept and passed around."""
    return hashlib.sha256(key.encode()).hexdigest()


def _size(text: str, where: str) -> int:
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ConfigError(where, text, "not a size", "give bytes, e.g. 1073741824, 512MiB or 2G")
    base = 1024 if m.group(3).startswith("i") else 1000
    scale: int = base ** _UNITS[m.group(2)]
    return int(m.group(1)) * scale


def parse_keys_file(text: str, path: str = "api_keys") -> dict[str, Tenant]:
    """Key digest -> tenant of a keys file's ``text``.

    Raises:
        ConfigError: naming the line (never the key) and what is wrong with it.
    """
    out: dict[str, Tenant] = {}
    quotas: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{path}:{number}"
        if len(fields) not in (2, 3):
            raise ConfigError(where, f"{len(fields)} fields", "malformed", "write KEY TENANT")
        key, name = fields[0], fields[1]
        if len(key) < 8:
            raise ConfigError(where, "a key", "shorter than 8 characters", "use a longer key")
        if not _TENANT.fullmatch(name):
            raise ConfigError(
                where, name, "not a tenant name", "use 1-64 of A-Z a-z 0-9 . _ @ -, first alnum"
            )
        quota = 0
        if len(fields) == 3:
            label, _, value = fields[2].partition("=")
            if label != "quota":
                raise ConfigError(where, fields[2], "unknown field", "write quota=BYTES")
            quota = _size(value, f"{where} quota")
        digest = key_digest(key)
        if digest in out:
            raise ConfigError(where, "a key", "listed twice", "give each key one line")
        if quotas.setdefault(name, quota) != quota:
            raise ConfigError(where, name, "has another quota on another line", "give one")
        out[digest] = Tenant(name, quota)
    return out


def check_cache_salt(salt: str) -> None:
    """Refuse a caller's ``cache_salt`` that could name someone else's pages.

    Raises:
        ValueError: over :data:`MAX_CACHE_SALT_CHARS` characters, or a control character.
    """
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt has {len(salt)} characters, at most {MAX_CACHE_SALT_CHARS}")
    if any(ord(c) < 32 or ord(c) == 127 for c in salt):
        raise ValueError("cache_salt holds a control character")


def request_salt(deployment: str, tenant: Tenant | None, cache_salt: str = "") -> str:
    """The cache salt of a call: ``deployment``'s salt alone (no tenant, no salt; the
    pages every keyless caller shares), the call's ``cache_salt`` alone (no tenant and no
    deployment salt: vLLM's and SGLang's ``cache_salt``, naming the same L3 pages), else
    all three joined by NUL characters, which no caller's salt holds."""
    if tenant is None:
        if not cache_salt:
            return deployment
        return f"{deployment}\x00salt\x00{cache_salt}" if deployment else cache_salt
    return tenant_salt(deployment, tenant.name, cache_salt)


def tenant_owner(deployment: str, tenant: Tenant) -> str:
    """The owner tag of ``tenant``'s L3 pages on a deployment salted ``deployment``: what
    its quota is set for (:func:`hicache_ray.keys.tenant.owner_of` of any of its salts)."""
    return owner_of(tenant_salt(deployment, tenant.name))


class ApiKeys:
    """The keys a door accepts: ``digests`` (of ``--api-key`` keys, each its own tenant)
    and a keys file at ``path`` (read again when it changes; ``on_change`` is told its
    tenants each time, the first read included). No key at all: every call is let in, as
    no tenant."""

    def __init__(
        self,
        digests: Iterable[str] = (),
        path: str = "",
        *,
        reload_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[list[Tenant]], None] | None = None,
    ) -> None:
        self._on_change = on_change  # told the tenants each time the file is (re)read
        self._fixed = {d: Tenant(f"key-{d[:16]}") for d in digests}
        self._path, self._reload_s, self._clock = path, reload_s, clock
        self._stamp: tuple[int, int] | None = None
        self._checked = float("-inf")
        self._from_file: dict[str, Tenant] = {}
        if path:
            self._reload(first=True)

    @property
    def enabled(self) -> bool:
        """Whether calls need a key."""
        return bool(self._fixed or self._path)

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The tenant of a call's ``Authorization`` header; None when no key is needed.

        Raises:
            PermissionError: a key is needed and the header carries no known one.
        """
        if not self.enabled:
            return None
        if self._path and self._clock() - self._checked >= self._reload_s:
            self._reload()
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise PermissionError("missing API key: send Authorization: Bearer <key>")
        digest = key_digest(key.strip())
        found = self._fixed.get(digest) or self._from_file.get(digest)
        if found is None:
            raise PermissionError("invalid API key")
        return found

    def _reload(self, *, first: bool = False) -> None:
        self._checked = self._clock()
        try:
            st = os.stat(self._path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            with open(self._path, encoding="utf-8") as f:
                keys = parse_keys_file(f.read(), self._path)
        except (OSError, UnicodeDecodeError, ConfigError) as exc:
            if first:
                raise ConfigError("api_keys", self._path, str(exc), "fix the keys file") from None
            log.error("api keys %s not reloaded, the keys in force stay: %s", self._path, exc)
            return
        self._stamp, self._from_file = stamp, keys
        log.info("api keys %s: %d keys, %d tenants", self._path, len(keys), self.num_tenants)
        if self._on_change is not None:
            self._on_change(self.tenants())

    def tenants(self) -> list[Tenant]:
        """Every tenant the door knows, once each."""
        return list(dict.fromkeys([*self._fixed.values(), *self._from_file.values()]))

    @property
    def num_tenants(self) -> int:
        """Tenants the door knows (each ``--api-key`` one; the file's by name)."""
        return len(self._fixed) + len({t.name for t in self._from_file.values()})
