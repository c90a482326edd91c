from __future__ import annotations

import itertools
import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.structured.tools import (
    Function,
    ToolCallReader,
    call_text,
    closed_objects,
    render_history,
    template_history,
    tool_grammar,
)
from kvgate.tokenizer import Tokenizer

WEATHER = Function(
    "get_weather", "Weather now",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)  # fmt: skip
ADD = Function(
    "add", None,
    {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]},
)  # fmt: skip
CALLS = call_text("add", '{"a":1.5}') + "\n" + call_text("get_weather", '{"city":"P\\"a}ris"}')


def _read(pieces: list[str], may_call: bool = True) -> tuple[str, list[tuple[str, str]], str]:
    """(content, calls, arguments rebuilt from the deltas) of ``pieces`` fed in turn."""
    reader = ToolCallReader(may_call)
    deltas = [d for p in pieces for d in reader.feed(p)] + reader.finish()
    content = "".join(d.content for d in deltas)
    rebuilt = "".join(d.arguments for d in deltas)
    return content, [(c.name, c.arguments) for c in reader.calls], rebuilt


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, len(CALLS) - 1), max_size=12, unique=True))
def test_calls_read_the_same_however_the_stream_is_cut(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(CALLS)]
    pieces = [CALLS[a:b] for a, b in itertools.pairwise(bounds)]
    content, calls, rebuilt = _read(pieces)
    assert content == ""
    assert calls == [("add", '{"a":1.5}'), ("get_weather", '{"city":"P\\"a}ris"}')]
    assert rebuilt == '{"a":1.5}{"city":"P\\"a}ris"}'
    for _, arguments in calls:
        json.loads(arguments)


def test_text_is_content_and_held_back_only_while_it_may_start_a_call() -> None:
    reader = ToolCallReader(True)
    assert reader.feed("<tool") == []  # could still be a call
    out = reader.feed("box> is a tag")
    assert "".join(d.content for d in out) == "<toolbox> is a tag"
    assert _read(["Hello ", "there"]) == ("Hello there", [], "")
    assert _read(["<tool_call> anything"], may_call=False)[0] == "<tool_call> anything"


def test_history_is_written_as_the_model_reads_calls() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
    ]  # fmt: skip
    out = render_history(messages, [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == call_text("get_weather", '{"city":"Oslo"}')
    assert out[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)


@pytest.fixture(scope="module")
def lltok(smollm2_tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(smollm2_tokenizer.backend.to_str(), eos_token=[2])


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        ("auto", True, "It is sunny.", True),
        ("auto", True, CALLS, True),
        ("auto", True, "\n " + CALLS, False),  # auto: the first character decides...
        ("auto", True, " It is sunny.", False),  # ...and whitespace is not one
        ("required", True, "\n " + CALLS, True),
        ("required", True, "\n" * 5 + CALLS, False),  # a few characters of whitespace at most
        ("auto", True, "  <tool_call> not json", False),
        ("required", True, "It is sunny.", False),
        ("required", True, CALLS, True),
        ("required", False, CALLS, False),  # two calls
        ("required", False, call_text("add", '{"a":2}'), True),
        ("add", True, call_text("get_weather", '{"city":"x"}'), False),
        ("add", True, call_text("add", '{"b":2}'), False),  # arguments must validate
        ("add", True, call_text("add", '{"a":2}') + "\n" + call_text("add", '{"a":3}'), False),
        ("none", True, CALLS, False),
        ("none", True, "Plain text.", True),
    ],
)
def test_the_grammar_allows_what_the_choice_allows(
    lltok: llguidance.LLTokenizer, smollm2_tokenizer: Tokenizer,
    choice: str, parallel: bool, text: str, ok: bool,
) -> None:  # fmt: skip
    mode, name = (choice, None) if choice in ("auto", "none", "required") else ("named", choice)
    grammar = tool_grammar([WEATHER, ADD], mode, parallel, name)
    matcher = llguidance.LLMatcher(lltok, grammar.text)
    assert not matcher.is_error(), matcher.get_error()
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    accepted = matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    assert accepted == ok


def test_objects_with_properties_are_closed_unless_the_schema_says_otherwise() -> None:
    item = {"type": "object", "properties": {"n": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": item},
            "either": {"anyOf": [item, {"type": "string"}]},
            "free": {"type": "object"},  # no properties: a free-form map, left open
            "open": {**item, "additionalProperties": True},
            "typed": {**item, "additionalProperties": {"type": "object", "properties": {}}},
            "ref": {"$ref": "#/$defs/thing"},
        },
        "$defs": {"thing": item},
    }
    closed = closed_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"]["additionalProperties"] is False
    assert closed["$defs"]["thing"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in item  # a copy


@pytest.mark.parametrize(
    ("parameters", "ok"),
    [
        (WEATHER.parameters, False),  # no additionalProperties: closed
        ({**WEATHER.parameters, "additionalProperties": True}, True),
        ({"type": "object"}, True),  # free-form arguments
    ],
)
def test_a_tool_call_with_a_key_its_schema_does_not_list(
    lltok: llguidance.LLTokenizer, smollm2_tokenizer: Tokenizer, parameters: dict[str, object],
    ok: bool,
) -> None:  # fmt: skip
    grammar = tool_grammar([Function("get_weather", None, parameters)], "required", False)
    matcher = llguidance.LLMatcher(lltok, grammar.text)
    text = call_text("get_weather", '{"city":"Paris","units":"metric"}')
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert (matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()) == ok


def test_a_function_may_be_called_like_a_mode(
    lltok: llguidance.LLTokenizer, smollm2_tokenizer: Tokenizer
) -> None:
    none = Function("none", None, {"type": "object", "properties": {}})
    matcher = llguidance.LLMatcher(lltok, tool_grammar([none], "named", True, "none").text)
    ids = smollm2_tokenizer.encode(call_text("none", "{}"), add_special_tokens=False)
    assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_history_content_as_text_parts_is_flattened() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "checking"}],
         "tool_calls": [{"function": {"name": "add", "arguments": '{"a":1}'}}]},
        {"role": "tool", "content": [{"type": "text", "text": "2"}]},
    ]  # fmt: skip
    out = render_history(messages, [ADD])
    assert out[1]["content"] == "a\nb"
    assert out[2]["content"] == "checking\n" + call_text("add", '{"a":1}')
    assert out[3]["content"] == "<tool_response>\n2\n</tool_response>"


def test_templates_that_render_calls_get_arguments_as_objects() -> None:
    good = {"id": "c", "function": {"name": "add", "arguments": '{"a":1}'}}
    bad = {"id": "d", "function": {"name": "add", "arguments": "oops"}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [good, bad]}]
    calls = template_history(messages)[0]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"a": 1}
    assert calls[1]["function"]["arguments"] == "oops"  # not JSON: left as sent


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize(
    ("mode", "text", "ok"),
    [
        ("auto", CALLS, True),  # a call, as without a format
        ("auto", '{"ok":true}', True),  # or an answer in the format
        ("auto", '{"ok":"yes"}', False),  # ...valid against it
        ("auto", '{"ok":true,"more":1}', False),  # (closed as the schema says)
        ("auto", "It is sunny.", False),  # free text is not the format
        ("auto", '{"ok":true}\n' + CALLS, False),  # an answer, then nothing
        ("required", CALLS, True),  # required: calls only, the format does not apply
        ("required", '{"ok":true}', False),
    ],
)
def test_tools_beside_a_format_allow_a_call_or_an_answer_in_it(
    lltok: llguidance.LLTokenizer, smollm2_tokenizer: Tokenizer, mode: str, text: str, ok: bool
) -> None:
    schema = {**ANSWER, "additionalProperties": False}
    grammar = tool_grammar([WEATHER, ADD], mode, True, answer=schema)
    matcher = llguidance.LLMatcher(lltok, grammar.text)
    assert not matcher.is_error(), matcher.get_error()
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert (matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()) == ok
