"""API keys file: plain and hashed keys, tenants, clear errors for a bad file."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvgate.errors import InvalidConfig
from kvgate.governance.tenants import DEFAULT_TENANT, TenantsConfig
from kvgate.server.auth import load_api_keys_file


def test_open_server_maps_everyone_to_the_default_tenant() -> None:
    keys = TenantsConfig.open_config()
    assert keys.open
    assert keys.tenant_of(None) == DEFAULT_TENANT
    assert keys.tenant_of("Bearer anything") == DEFAULT_TENANT


def test_plain_and_hashed_keys(tmp_path: Path) -> None:
    hashed = hashlib.sha256(b"sk-beta").hexdigest()
    path = tmp_path / "keys"
    path.write_text(
        f"# keys\nsk-alpha team-a\n\nsha256:{hashed} team-b  # stored hashed\nsk-solo\n"
    )
    table = load_api_keys_file(path)
    keys = TenantsConfig.from_key_table(table)
    assert keys.tenant_of("Bearer sk-alpha") == "team-a"
    assert keys.tenant_of("bearer sk-beta") == "team-b"
    assert keys.tenant_of("Bearer sk-solo") == DEFAULT_TENANT
    # No key, a wrong key, the hash itself, or another scheme: refused.
    for header in (None, "", "Bearer ", "Bearer sk-wrong", f"Bearer {hashed}", "Basic sk-alpha"):
        assert keys.tenant_of(header) is None
    # Keys are not kept in the clear.
    assert b"sk-alpha" not in repr(table).encode()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "has no keys"),
        ("k1 t1 extra\n", "keys:1: expected 'KEY \\[TENANT\\]'"),
        ("sha256:abcd team\n", "64 hex digits"),
    ],
)
def test_bad_files_are_refused_with_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(InvalidConfig, match=message) as info:
        load_api_keys_file(path)
    assert info.value.param == "api_keys_file"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="cannot read api keys file"):
        load_api_keys_file(tmp_path / "absent")
