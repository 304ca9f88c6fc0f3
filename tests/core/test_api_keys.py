"""API keys, tenants and cache salts of the HTTP door (no Ray): the keys file's grammar and
its errors (which never name a key), reloading, and salts no caller can forge."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_ray.base.errors import ConfigError
from hicache_ray.keys.tenant import owner_of
from hicache_ray.serving.serve_options import serve_keys
from hicache_ray.serving.tenants import (
    MAX_CACHE_SALT_CHARS,
    ApiKeys,
    Tenant,
    check_cache_salt,
    key_digest,
    parse_keys_file,
    request_salt,
    tenant_owner,
)
from tests.helpers import FakeClock


def test_a_keys_file_maps_keys_to_tenants_with_quotas() -> None:
    keys = parse_keys_file(
        "# comment\n\nkey-aaaa-1 alice quota=2GiB  # trailing\nkey-aaaa-2 alice quota=2GiB\n"
        "key-bbbb-1 bob\nkey-cccc-1 carol quota=512M\nkey-dddd-1 dave quota=4096\n"
    )
    assert keys[key_digest("key-aaaa-1")] == Tenant("alice", 2 << 30)
    assert keys[key_digest("key-aaaa-2")] == Tenant("alice", 2 << 30)
    assert keys[key_digest("key-bbbb-1")] == Tenant("bob", 0)
    assert keys[key_digest("key-cccc-1")] == Tenant("carol", 512_000_000)
    assert keys[key_digest("key-dddd-1")] == Tenant("dave", 4096)
    assert "key-aaaa-1" not in keys  # kept as digests only


@pytest.mark.parametrize(
    ("text", "line", "why"),
    [
        ("secret-key-1\n", 1, "malformed"),
        ("ok-key-0001 a\nshort b\n", 2, "shorter than 8"),
        ("secret-key-1 -bad\n", 1, "not a tenant name"),
        ("secret-key-1 a b c\n", 1, "malformed"),
        ("secret-key-1 a limit=3\n", 1, "unknown field"),
        ("secret-key-1 a quota=lots\n", 1, "not a size"),
        ("secret-key-1 a\nsecret-key-1 b\n", 2, "listed twice"),
        ("secret-key-1 a quota=1G\nsecret-key-2 a quota=2G\n", 2, "another quota"),
    ],
)
def test_a_bad_line_is_named_without_its_key(text: str, line: int, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        parse_keys_file(text, "keys.txt")
    assert f"keys.txt:{line}" in str(err.value)
    assert "secret-key" not in str(err.value)


def test_keys_are_checked_and_the_file_is_read_again_when_it_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text("alice-key-1 alice\n")
    clock = FakeClock()
    keys = ApiKeys([key_digest("solo-key-0")], str(path), reload_s=5, clock=clock)
    assert keys.enabled and keys.num_tenants == 2
    assert keys.tenant("Bearer alice-key-1") == Tenant("alice")
    assert keys.tenant("bearer  solo-key-0 ") == Tenant(f"key-{key_digest('solo-key-0')[:16]}")
    for header in (None, "", "Bearer", "Basic alice-key-1", "Bearer alice-key-2"):
        with pytest.raises(PermissionError):
            keys.tenant(header)
    path.write_text("alice-key-2 alice\nbob-key-111 bob\n")
    clock.now = 4.9  # not yet looked at again
    with pytest.raises(PermissionError):
        keys.tenant("Bearer bob-key-111")
    clock.now = 5.0
    assert keys.tenant("Bearer bob-key-111") == Tenant("bob")
    with pytest.raises(PermissionError):
        keys.tenant("Bearer alice-key-1")  # removed from the file
    path.write_text("bob-key-111 bob\nbroken-line-secret\n")
    clock.now = 10.0
    with caplog.at_level(logging.ERROR):
        assert keys.tenant("Bearer bob-key-111") == Tenant("bob")  # the keys in force stay
        assert keys.tenant("Bearer alice-key-2") == Tenant("alice")
    assert "not reloaded" in caplog.text and "secret" not in caplog.text
    path.unlink()
    clock.now = 20.0
    assert keys.tenant("Bearer alice-key-2") == Tenant("alice")  # a missing file: the same


def test_no_keys_let_every_call_in_and_a_bad_start_is_refused(tmp_path: Path) -> None:
    assert ApiKeys().tenant(None) is None and not ApiKeys().enabled
    with pytest.raises(ConfigError, match="api_keys"):
        ApiKeys((), str(tmp_path / "absent"))
    bad = tmp_path / "bad"
    bad.write_text("only-one-field\n")
    with pytest.raises(ConfigError, match="bad:1"):
        serve_keys({"api_keys": str(bad)})
    with pytest.raises(ConfigError, match="hex digest"):
        serve_keys({"api_key_sha256": "abc"})
    spec = serve_keys({"api_key_sha256": key_digest("k").upper()})
    assert spec.digests == (key_digest("k"),) and spec.enabled and not serve_keys({}).enabled


def test_a_callers_salt_is_bounded_and_has_no_control_characters() -> None:
    check_cache_salt("x" * MAX_CACHE_SALT_CHARS)
    for bad in ("x" * (MAX_CACHE_SALT_CHARS + 1), "a\x00b", "tab\there", "\x7f"):
        with pytest.raises(ValueError, match="cache_salt"):
            check_cache_salt(bad)


def test_salts_follow_vllm_without_a_tenant() -> None:
    assert request_salt("", None) == "" and request_salt("dep", None) == "dep"
    assert request_salt("", None, "s") == "s"  # SGLang's and vLLM's cache_salt: same pages
    assert request_salt("dep", None, "s") not in ("s", "dep")


_SALT = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=8)
_CALLS = st.tuples(
    _SALT, st.one_of(st.none(), st.from_regex(r"[a-z][a-z0-9.]{0,5}", fullmatch=True)), _SALT
)


def _canon(call: tuple[str, str | None, str]) -> tuple[str, ...]:
    """What a call's salt must stand for: its tenant's cache, or the one salt it names."""
    dep, name, own = call
    if name:
        return ("tenant", dep, name, own)
    if not own or not dep:
        return ("salt", own or dep)  # a deployment's salt and a caller's name the same pages
    return ("both", dep, own)


@given(a=_CALLS, b=_CALLS)
def test_two_calls_share_a_salt_only_when_they_stand_for_the_same_cache(
    a: tuple[str, str | None, str], b: tuple[str, str | None, str]
) -> None:
    def salt(call: tuple[str, str | None, str]) -> str:
        dep, name, own = call
        return request_salt(dep, Tenant(name) if name else None, own)

    assert (salt(a) == salt(b)) == (_canon(a) == _canon(b))


def test_the_door_is_told_its_tenants_and_their_owners_each_read(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("alice-key-1 alice quota=1M\nalice-key-2 alice quota=1M\nbob-key-111 bob\n")
    told: list[list[Tenant]] = []
    clock = FakeClock()
    keys = ApiKeys([key_digest("solo-key-0")], str(path), clock=clock, on_change=told.append)
    solo = Tenant(f"key-{key_digest('solo-key-0')[:16]}")
    assert told == [[solo, Tenant("alice", 1_000_000), Tenant("bob")]]
    path.write_text("bob-key-111 bob quota=2k\n")
    clock.now = 60
    keys.tenant("Bearer bob-key-111")
    assert told[-1] == [solo, Tenant("bob", 2000)]
    # a tenant's owner is that of every salt of it, and only of its own
    alice = tenant_owner("dep", Tenant("alice"))
    assert alice == owner_of(request_salt("dep", Tenant("alice"), "any"))
    assert alice not in (tenant_owner("", Tenant("alice")), tenant_owner("dep", Tenant("bob")))
    assert owner_of(request_salt("dep", None, "x")) == "" == owner_of("")
