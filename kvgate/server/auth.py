"""The plain API keys file: ``KEY [TENANT]`` lines -> a key table for ``TenantsConfig``.

    # comment
    sk-team-a-1234           team-a
    sha256:9f86d08...        team-b     # the key stored as its SHA-256 hex digest

Keys are held only as SHA-256 digests. The tenants file (``--tenants``) says more per tenant;
this file only names who is who, with default limits.
"""

from __future__ import annotations

import os

from kvgate.errors import InvalidConfig
from kvgate.governance.tenants import DEFAULT_TENANT, parse_key


def load_api_keys_file(path: str | os.PathLike[str]) -> dict[bytes, str]:
    """Digest of each key -> tenant name."""
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise InvalidConfig(
            f"cannot read api keys file {where!r}: {exc.strerror}", param="api_keys_file"
        ) from exc
    table: dict[bytes, str] = {}
    for lineno, raw in enumerate(lines, 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise InvalidConfig(
                f"{where}:{lineno}: expected 'KEY [TENANT]', got {len(fields)} fields",
                param="api_keys_file",
            )
        try:
            digest = parse_key(fields[0], f"{where}:{lineno}")
        except InvalidConfig as exc:
            raise InvalidConfig(exc.message, param="api_keys_file") from exc
        table[digest] = fields[1] if len(fields) == 2 else DEFAULT_TENANT
    if not table:
        raise InvalidConfig(f"api keys file {where!r} has no keys", param="api_keys_file")
    return table
