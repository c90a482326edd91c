"""OpenAI's attribute filters for vector-store search: a comparison
``{"type": "eq"|"ne"|"gt"|"gte"|"lt"|"lte"|"in"|"nin", "key", "value"}`` or a compound
``{"type": "and"|"or", "filters": [...]}``. ``check`` refuses a malformed one before any
search runs; ``matches`` applies one to a chunk's attributes."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

from kvgate.errors import InvalidRequest

_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "gte": operator.ge,
    "lt": operator.lt,
    "lte": operator.le,
    "in": lambda a, b: a in b,
    "nin": lambda a, b: a not in b,
}


def check(f: Any, param: str = "filters", depth: int = 0) -> None:
    if depth > 8:
        raise InvalidRequest("filters are nested too deeply (at most 8 levels)", param=param)
    if not isinstance(f, Mapping):
        raise InvalidRequest("a filter must be an object", param=param)
    kind = f.get("type")
    if kind in ("and", "or"):
        subs = f.get("filters")
        if not isinstance(subs, list) or not subs:
            raise InvalidRequest(f"a {kind!r} filter needs a non-empty 'filters' list", param=param)
        for i, sub in enumerate(subs):
            check(sub, f"{param}.filters[{i}]", depth + 1)
        return
    if kind not in _COMPARE:
        raise InvalidRequest(
            f"filter type must be one of {', '.join([*_COMPARE, 'and', 'or'])}, got {kind!r}",
            param=f"{param}.type",
        )
    if not isinstance(f.get("key"), str):
        raise InvalidRequest("a comparison filter needs a string 'key'", param=f"{param}.key")
    value = f.get("value")
    scalar = (str, int, float, bool)
    ok = (
        isinstance(value, list) and all(isinstance(v, scalar) for v in value)
        if kind in ("in", "nin")
        else isinstance(value, scalar)
    )
    if not ok:
        raise InvalidRequest(
            "a filter's 'value' must be a string, number or boolean (a list of them for "
            "'in' and 'nin')",
            param=f"{param}.value",
        )


def matches(f: Mapping[str, Any], attributes: Mapping[str, Any]) -> bool:
    kind = f["type"]
    if kind == "and":
        return all(matches(sub, attributes) for sub in f["filters"])
    if kind == "or":
        return any(matches(sub, attributes) for sub in f["filters"])
    if f["key"] not in attributes:
        return kind in ("ne", "nin")
    try:
        return bool(_COMPARE[kind](attributes[f["key"]], f["value"]))
    except TypeError:  # e.g. a number compared with a string: not a match
        return False
