from __future__ import annotations

import pytest

from kvgate.errors import InvalidRequest
from kvgate.structured import spec


def test_bounded_numbers_walks_schema_positions_only() -> None:
    schema = {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0},
            "step": {"type": "number", "multipleOf": 0.5},
            "maybe": {"type": ["number", "null"]},
            "count": {"type": "integer"},
            "list": {"type": "array", "items": {"type": "number"}},
            "either": {"anyOf": [{"type": "number"}, {"type": "string"}]},
            "fixed": {"const": {"type": "number"}},  # data, not a schema
            "listed": {"type": "number", "enum": [0.1234567, 2]},  # values kept reachable
            "tiny": {"type": "number", "minimum": 1e-7, "maximum": 9e-7},
        },
        "$defs": {"n": {"type": "number"}},
    }
    out = spec.bounded_numbers(schema)
    p = out["properties"]
    tick = 10.0**-spec.NUMBER_DECIMALS
    assert p["price"]["multipleOf"] == tick and p["maybe"]["multipleOf"] == tick
    assert p["step"]["multipleOf"] == 0.5  # the schema's own
    assert "multipleOf" not in p["count"]
    assert p["list"]["items"]["multipleOf"] == tick
    assert p["either"]["anyOf"][0]["multipleOf"] == tick
    assert p["fixed"] == {"const": {"type": "number"}}
    assert out["$defs"]["n"]["multipleOf"] == tick
    assert "multipleOf" not in p["listed"] and "multipleOf" not in p["tiny"]
    assert "multipleOf" not in schema["properties"]["price"]  # the input is untouched


@pytest.mark.parametrize(
    ("build", "arg"),
    [
        (spec.json_schema_grammar, "not a schema"),
        (spec.regex_grammar, ""),
        (spec.choice_grammar, []),
        (spec.choice_grammar, ["a", ""]),
        (spec.choice_grammar, "abc"),
        (spec.lark_grammar, "  "),
        (spec.regex_grammar, "a" * (spec.MAX_GRAMMAR_CHARS + 1)),
    ],
)
def test_malformed_constraints_name_their_field(build: object, arg: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        build(arg, "response_format.x")  # type: ignore[operator]
    assert info.value.param == "response_format.x"


def test_choice_literals_are_escaped() -> None:
    g = spec.choice_grammar(['say "hi"', "back\\slash", "new\nline"], "c")
    assert g.kind == "choice" and '\\"hi\\"' in g.text
