"""Tenant salts and owners: how a tenant's cache salt is spelled, and the owner tag its L3
pages carry (what a store's per-tenant quota counts).

A tenant's salt is ``deployment NUL "tenant" NUL name NUL cache_salt``
(:func:`tenant_salt`); no caller's ``cache_salt`` holds a control character, so no other
salt can spell it. The owner of a salt is a digest of its tenant part, so every
``cache_salt`` of one tenant counts against that tenant's quota; salts of no tenant have
no owner.
"""

from __future__ import annotations

import hashlib

__all__ = ["owner_of", "tenant_salt"]

_MARK = "\x00tenant\x00"


def tenant_salt(deployment: str, name: str, cache_salt: str = "") -> str:
    """The cache salt of tenant ``name``'s calls on a deployment salted ``deployment``."""
    return f"{deployment}{_MARK}{name}\x00{cache_salt}"


def owner_of(salt: str) -> str:
    """The owner tag of a cache salt: ``t-`` and 16 hex digits for a tenant's, ``""`` for
    any other."""
    if _MARK not in salt:
        return ""
    tenant = salt.rsplit("\x00", 1)[0]  # without the caller's own cache_salt
    return "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:16]
