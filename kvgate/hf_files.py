"""Reading the JSON side files of a Hugging Face checkpoint (config, tokenizer and generation
configs), with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvgate.errors import CorruptWeights


def read_json_object(path: Path, *, missing_ok: bool = False) -> dict[str, Any]:
    """A JSON object file's contents (``{}`` for a missing file when ``missing_ok``).

    Unreadable, malformed or not-an-object files raise ``CorruptWeights`` naming the file.
    """
    if missing_ok and not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptWeights(f"cannot parse {path}: {exc}", path=str(path)) from exc
    if not isinstance(data, dict):
        raise CorruptWeights(f"{path} must hold a JSON object", path=str(path))
    return data


def int_list(value: object) -> list[int]:
    """Token ids given as an int, a list of ints, or absent (booleans are not ids)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
