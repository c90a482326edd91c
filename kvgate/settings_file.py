"""Reading a settings file (TOML, or YAML by extension) into a table, with errors that name
the file and say what is wrong. Used by the server's config file and the tenants file."""

from __future__ import annotations

import os
import tomllib
from typing import Any

import yaml

from kvgate.errors import InvalidConfig


def read_table(path: str | os.PathLike[str], *, what: str, param: str) -> dict[str, Any]:
    """The file's top-level table; ``what`` names the file in errors ("config file")."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise InvalidConfig(f"cannot read {what} {where!r}: {exc.strerror}", param=param) from exc
    try:
        if where.endswith((".yaml", ".yml")):
            data = yaml.safe_load(raw) or {}
        else:
            data = tomllib.loads(raw.decode())
    except (yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidConfig(f"{what} {where!r} is not valid: {exc}", param=param) from exc
    if not isinstance(data, dict):
        raise InvalidConfig(f"{what} {where!r} must hold a table of settings", param=param)
    return data
