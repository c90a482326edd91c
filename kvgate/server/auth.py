"""API keys: ``Authorization: Bearer KEY`` -> the tenant the key belongs to.

The keys file has one key per line, optionally followed by a tenant name::

    # comment
    sk-team-a-1234           team-a
    sha256:9f86d08...        team-b     # the key stored as its SHA-256 hex digest

Keys are held only as SHA-256 digests and compared in constant time. Without a keys file the
server is open and every request belongs to the ``default`` tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from kvgate.errors import InvalidConfig

DEFAULT_TENANT = "default"


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKeys:
    """Digest of each key -> tenant. Empty means the server is open."""

    tenants_by_digest: dict[bytes, str]

    @property
    def enabled(self) -> bool:
        return bool(self.tenants_by_digest)

    @classmethod
    def open(cls) -> ApiKeys:
        return cls({})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ApiKeys:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise InvalidConfig(
                f"cannot read api keys file {os.fspath(path)!r}: {exc.strerror}",
                param="api_keys_file",
            ) from exc
        table: dict[bytes, str] = {}
        for lineno, raw in enumerate(lines, 1):
            fields = raw.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise InvalidConfig(
                    f"{os.fspath(path)}:{lineno}: expected 'KEY [TENANT]', "
                    f"got {len(fields)} fields",
                    param="api_keys_file",
                )
            key, tenant = fields[0], fields[1] if len(fields) == 2 else DEFAULT_TENANT
            if key.startswith("sha256:"):
                try:
                    digest = bytes.fromhex(key.removeprefix("sha256:"))
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    raise InvalidConfig(
                        f"{os.fspath(path)}:{lineno}: 'sha256:' must be followed by 64 hex digits",
                        param="api_keys_file",
                    )
            else:
                digest = key_digest(key)
            table[digest] = tenant
        if not table:
            raise InvalidConfig(
                f"api keys file {os.fspath(path)!r} has no keys", param="api_keys_file"
            )
        return cls(table)

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant of a ``Bearer`` header value, or None if the key is missing or wrong."""
        if not self.enabled:
            return DEFAULT_TENANT
        if not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = key_digest(key.strip())
        found = None
        for known, tenant in self.tenants_by_digest.items():  # constant time per key
            if hmac.compare_digest(known, digest):
                found = tenant
        return found
