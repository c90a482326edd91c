"""What a request's output must match: a ``Grammar``, built from the API's fields.

A ``Grammar`` is plain data (frozen, hashable): the llguidance grammar text and what it came
from. It travels in ``SamplingParams`` from the server to the runner, which turns it into a
matcher through the ``GrammarCompiler`` cache. Builders here check the *shape* of what the
client sent; whether the schema, regex or grammar compiles is ``GrammarCompiler.check``'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from kvgate.errors import InvalidRequest

#: Longest grammar text a request may send (a JSON schema, a regex, a Lark grammar); a
#: grammar's compile time grows with it, and it is compiled before the request is admitted.
MAX_GRAMMAR_CHARS = 64 * 1024
#: Most strings of a ``choice``.
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Grammar:
    """``kind``: json_schema, json_object, regex, choice, grammar or tools. ``text``: the
    llguidance grammar (its JSON form or Lark). ``param``: the request field it came from,
    named in errors."""

    kind: str
    text: str
    param: str


def json_schema_grammar(schema: Mapping[str, Any] | bool, param: str) -> Grammar:
    """Output that parses as JSON and validates against ``schema``."""
    if not isinstance(schema, (Mapping, bool)):
        raise InvalidRequest("the JSON schema must be an object", param=param)
    raw = json.dumps(schema)
    check_size(raw, param)
    raw = json.dumps(bounded_numbers(schema))
    try:
        # Compact JSON (no optional whitespace): fewer tokens, and no run of whitespace a
        # sampled model could loop in.
        text = llguidance.LLMatcher.grammar_from_json_schema(
            raw, overrides={"whitespace_flexible": False}
        )
    except ValueError as exc:
        raise InvalidRequest(f"invalid JSON schema: {exc}", param=param) from exc
    return Grammar("json_schema", text, param)


#: Decimal places of a generated ``number`` whose schema sets no ``multipleOf``. Any number
#: the schema allows with at most this many decimals is allowed; what is cut is an endless
#: run of digits (a model sampled at a high temperature writes "0.85176528576846182841..."
#: until max_tokens) and the exponent form.
NUMBER_DECIMALS = 6
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = (
    "items", "additionalProperties", "not", "if", "then", "else", "contains",
    "unevaluatedProperties", "unevaluatedItems", "propertyNames",
)  # fmt: skip


def bounded_numbers(schema: Any) -> Any:
    """``schema`` with ``multipleOf: 10**-NUMBER_DECIMALS`` on every number subschema that
    has none (a subset of what it allows: every output still validates against the
    original). Only schema positions are walked, never ``const``/``enum``/``default`` data."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    kind = out.get("type")
    is_number = kind == "number" or (isinstance(kind, list) and "number" in kind)
    if is_number and "multipleOf" not in out and _room_for_decimals(out):
        out["multipleOf"] = 10.0**-NUMBER_DECIMALS
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: bounded_numbers(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_numbers(v) for v in out[key]]
    for key in _SCHEMA_ONES:
        if key in out:
            out[key] = bounded_numbers(out[key])
    return out


def _room_for_decimals(schema: Mapping[str, Any]) -> bool:
    """Whether cutting decimals keeps every value the schema allows reachable: not when it
    lists its values (``enum``, ``const``) or a bound has finer decimals than we keep."""
    if "enum" in schema or "const" in schema:
        return False
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        bound = schema.get(key)
        if isinstance(bound, (int, float)) and round(bound, NUMBER_DECIMALS) != bound:
            return False
    return True


def json_object_grammar(param: str) -> Grammar:
    """Any JSON object (OpenAI's ``json_object``)."""
    return Grammar("json_object", json_schema_grammar({"type": "object"}, param).text, param)


def regex_grammar(pattern: object, param: str) -> Grammar:
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequest("the regex must be a non-empty string", param=param)
    check_size(pattern, param)
    return Grammar("regex", llguidance.LLMatcher.grammar_from_regex(pattern), param)


def choice_grammar(choices: object, param: str) -> Grammar:
    """Exactly one of ``choices``."""
    if (
        not isinstance(choices, Sequence)
        or isinstance(choices, str)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise InvalidRequest("choice must be a non-empty list of non-empty strings", param=param)
    if len(choices) > MAX_CHOICES:
        raise InvalidRequest(f"choice allows at most {MAX_CHOICES} strings", param=param)
    lark = "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    check_size(lark, param)
    return Grammar("choice", llguidance.LLMatcher.grammar_from_lark(lark), param)


def lark_grammar(lark: object, param: str) -> Grammar:
    """A Lark grammar as llguidance reads it (``start`` is the output; ``%json {...}`` embeds
    a JSON schema; regexes between slashes)."""
    if not isinstance(lark, str) or not lark.strip():
        raise InvalidRequest("the grammar must be a non-empty string", param=param)
    check_size(lark, param)
    return Grammar("grammar", llguidance.LLMatcher.grammar_from_lark(lark), param)


def check_size(text: str, param: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(
            f"the grammar is {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are allowed",
            param=param,
        )
