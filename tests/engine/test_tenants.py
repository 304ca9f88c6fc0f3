"""Cache salts on one rank: requests of one salt share their prefixes in every tier (L1,
L2, L3) and never reach another salt's; a bad salt is refused alone."""

from __future__ import annotations

import pytest

from hicache_ray.engine.request import MAX_SALT_CHARS, GenerateRequest, RequestError, check_request
from hicache_ray.keys.tenant import owner_of, tenant_salt
from hicache_ray.storage import MemoryObjects
from tests.engine.test_runtime import assert_exact, drain, prompt, run, runtime


def _hits(result: object) -> tuple[int, int, int]:
    return (
        result.device_hit_tokens,  # type: ignore[attr-defined]
        result.host_hit_tokens,  # type: ignore[attr-defined]
        result.storage_hit_tokens,  # type: ignore[attr-defined]
    )


def _evict_all(rt: object) -> None:
    """Empty L1 and L2 of ``rt``: only L3 holds what was computed."""
    cache = rt.ctl.cache  # type: ignore[attr-defined]
    tree = cache.tree
    drain(rt)  # type: ignore[arg-type]
    cache.device_pool.allocator.free(tree.evict_device(tree.num_device_pages))
    cache.host_pool.allocator.free(tree.evict_host(tree.num_host_pages))
    assert tree.num_device_pages == tree.num_host_pages == 0
    assert len(tree.roots) == 0


def test_salts_share_nothing_in_any_tier() -> None:
    objects = MemoryObjects()
    tokens = prompt(7, 32)
    rt = runtime(objects)
    assert run(rt, GenerateRequest("alice1", tokens, 2, cache_salt="alice")).recomputed_tokens == 32
    drain(rt)
    alices = {key for key, _, _ in objects.scan()}
    bob = run(rt, GenerateRequest("bob1", tokens, 2, cache_salt="bob"))
    assert bob.recomputed_tokens == 32 and _hits(bob) == (0, 0, 0)  # alice's L1 is not his
    drain(rt)
    bobs = {key for key, _, _ in objects.scan()} - alices
    assert len(bobs) == len(alices) > 0  # his own L3 objects, none of hers
    plain = run(rt, GenerateRequest("plain1", tokens, 2))
    assert _hits(plain) == (0, 0, 0)  # nor the deployment's own
    again = run(rt, GenerateRequest("alice2", [*tokens, 1], 2, cache_salt="alice"))
    assert again.device_hit_tokens == 32
    rt.ctl.check_integrity()
    _evict_all(rt)
    rt.ctl.close()

    fresh = runtime(objects)  # a new deployment: only L3 holds the pages, under each salt
    carol = run(fresh, GenerateRequest("carol", [*tokens, 1], 2, cache_salt="carol"))
    assert _hits(carol) == (0, 0, 0)
    alice = run(fresh, GenerateRequest("alice3", [*tokens, 2], 4, cache_salt="alice"))
    assert alice.storage_hit_tokens == 32
    assert_exact(fresh, alice, [*tokens, 2])
    drain(fresh)
    fresh.ctl.check_integrity()
    fresh.ctl.close()


@pytest.mark.parametrize(
    ("salt", "why"), [(7, "expected a str"), ("x" * (MAX_SALT_CHARS + 1), "at most")]
)
def test_a_bad_salt_is_refused_alone(salt: object, why: str) -> None:
    with pytest.raises(RequestError, match=why):
        check_request(GenerateRequest("r", [1, 2], 1, cache_salt=salt))  # type: ignore[arg-type]
    rt = runtime(None)
    rt.submit(GenerateRequest("bad", [1, 2], 1, cache_salt=salt))  # type: ignore[arg-type]
    good = run(rt, GenerateRequest("good", [1, 2, 3], 1, cache_salt="ok"))
    assert good.error is None
    rt.ctl.close()


class _Owners(MemoryObjects):
    """A memory store that records the owner of every write."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: set[str] = set()

    def write_owned(self, keys, headers, payloads, owner):  # type: ignore[no-untyped-def]
        self.owners.add(owner)
        return super().write_owned(keys, headers, payloads, owner)


def test_backups_name_their_tenant_for_its_quota() -> None:
    """A tenant's pages reach L3 tagged with its owner (whatever its cache_salt); pages of
    no tenant go untagged."""
    objects = _Owners()
    rt = runtime(objects)
    run(rt, GenerateRequest("a", prompt(1, 16), 1, cache_salt=tenant_salt("", "alice", "x")))
    drain(rt)
    assert objects.owners == {owner_of(tenant_salt("", "alice"))}
    written = len(list(objects.scan()))
    run(rt, GenerateRequest("b", prompt(2, 16), 1, cache_salt="plain"))
    drain(rt)
    assert len(list(objects.scan())) > written  # stored, under no owner
    assert objects.owners == {owner_of(tenant_salt("", "alice"))}
    rt.ctl.close()
