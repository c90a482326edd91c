"""response_format and tools through the HTTP API and the official ``openai`` client, on the
tiny random-weight model: whatever the weights say, outputs match their constraints; bad
constraints are 400s naming the field, refused before admission."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL, LiveServer

SCHEMAS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "schemas.json").read_text()
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOL_SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.api_url, api_key=API_KEY, max_retries=0)


def _json_format(name: str) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name]["schema"], "strict": True},
    }


def _streamed_chat(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[Any], str | None]:
    """(content, tool-call deltas, finish reason) of a streamed chat."""
    content, deltas, finish = "", [], None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return content, deltas, finish


def _reassemble(deltas: list[Any]) -> list[dict[str, str]]:
    """Tool-call deltas -> calls, merged by index as the OpenAI SDK's helpers do."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = d.id or call["id"]
        if d.function is not None:
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def _check_call(name: str, arguments: str) -> None:
    schema = TOOL_SCHEMAS[name]["function"]["parameters"]  # type: ignore[index]
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["order", "event"])
def test_chat_json_schema_always_validates(client: openai.OpenAI, name: str, stream: bool) -> None:
    for seed in range(2):
        kwargs: dict[str, Any] = {
            "messages": [{"role": "user", "content": SCHEMAS[name]["prompt"]}],
            "response_format": _json_format(name), "max_tokens": 400, "temperature": 1.0,
            "seed": seed,
        }  # fmt: skip
        if stream:
            text, _, finish = _streamed_chat(client, **kwargs)
        else:
            resp = client.chat.completions.create(model=MODEL, **kwargs)
            text, finish = resp.choices[0].message.content or "", resp.choices[0].finish_reason
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMAS[name]["schema"])


def test_completions_take_response_format_too(live_server: LiveServer) -> None:
    pattern = r"(yes|no), because [a-z ]{3,20}\."
    for stream in (False, True):
        body = {
            "model": MODEL, "prompt": "Is it raining?", "max_tokens": 60, "stream": stream,
            "response_format": {"type": "regex", "regex": pattern}, "seed": 3,
        }  # fmt: skip
        resp = httpx.post(f"{live_server.api_url}/completions", json=body,
                          headers={"authorization": f"Bearer {API_KEY}"}, timeout=60)  # fmt: skip
        assert resp.status_code == 200, resp.text
        if stream:
            events = [json.loads(line[6:]) for line in resp.text.splitlines()
                      if line.startswith("data: {")]  # fmt: skip
            text = "".join(c["text"] for e in events for c in e["choices"])
        else:
            text = resp.json()["choices"][0]["text"]
        assert re.fullmatch(pattern, text), text


def test_json_object_and_choice(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    # Any object: random weights may write one string for ever (SmolLM2 closes it: e2e).
    text, finish = resp.choices[0].message.content or "", resp.choices[0].finish_reason
    assert text.startswith("{")
    assert finish == "length" or isinstance(json.loads(text), dict)
    choices = ["sunny", "rainy", "partly cloudy"]
    for seed in range(3):
        resp = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=10, seed=seed,
            extra_body={"response_format": {"type": "choice", "choice": choices}},
        )  # fmt: skip
        assert resp.choices[0].message.content in choices


def test_max_tokens_before_the_end_is_length_not_a_claim_of_validity(
    client: openai.OpenAI,
) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, response_format=_json_format("person"),
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_choice_always_yield_a_valid_call(
    client: openai.OpenAI, choice: str
) -> None:
    tool_choice: Any = "required"
    if choice == "named":
        tool_choice = {"type": "function", "function": {"name": "add"}}
    for seed in range(3):
        resp = client.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER, ADD], tool_choice=tool_choice,  # type: ignore[list-item]
            max_tokens=200, seed=seed, temperature=1.0,
        )  # fmt: skip
        message = resp.choices[0].message
        assert resp.choices[0].finish_reason == "tool_calls"
        assert message.tool_calls
        for call in message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            if choice == "named":
                assert call.function.name == "add"
            _check_call(call.function.name, call.function.arguments)


def test_one_call_only_without_parallel_tool_calls(client: openai.OpenAI) -> None:
    for seed in range(3):
        resp = client.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER, ADD], tool_choice="required",  # type: ignore[list-item]
            parallel_tool_calls=False, max_tokens=200, seed=seed,
        )  # fmt: skip
        assert len(resp.choices[0].message.tool_calls or []) == 1


def test_streamed_tool_call_deltas_reassemble_to_the_whole_response(
    client: openai.OpenAI,
) -> None:
    kwargs: dict[str, Any] = {
        "messages": USER, "tools": [WEATHER, ADD], "tool_choice": "required",
        "max_tokens": 200, "temperature": 0,
    }  # fmt: skip
    whole = client.chat.completions.create(model=MODEL, **kwargs)
    content, deltas, finish = _streamed_chat(client, **kwargs)
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    assert content == ""
    streamed = _reassemble(deltas)
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.choices[0].message.tool_calls or []
    ]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in streamed] == expected
    assert all(c["id"].startswith("call_") for c in streamed)
    # The first delta of each call names it; the arguments come as several fragments.
    assert len(deltas) > 2 * len(streamed)


def test_two_turn_exchange_with_the_tool_result_in_the_history(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
        max_tokens=200, seed=1,
    )  # fmt: skip
    call = (first.choices[0].message.tool_calls or [])[0]
    history: list[Any] = [
        *USER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",  # type: ignore[list-item]
        max_tokens=20, seed=1,
    )  # fmt: skip
    answer = second.choices[0]
    assert answer.message.tool_calls is None
    assert answer.finish_reason in ("stop", "length")
    assert not (answer.message.content or "").lstrip().startswith("<tool_call>")
    # The history reached the prompt: the call and its result as the model reads them.
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


def _post(live: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.api_url}{path}", json=body,
                      headers={"authorization": f"Bearer {API_KEY}"}, timeout=30)  # fmt: skip


@pytest.mark.parametrize(
    ("format_", "param"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema"),
        ({"type": "regex", "regex": "([a-z]"}, "response_format.regex"),
        ({"type": "grammar", "grammar": "start: missing_rule"}, "response_format.grammar"),
        ({"type": "choice", "choice": []}, "response_format.choice"),
    ],
)  # fmt: skip
def test_bad_constraints_are_a_400_naming_the_field_before_admission(
    live_server: LiveServer, format_: dict[str, Any], param: str
) -> None:
    before = live_server.state.usage.query()["totals"]["requests"]
    resp = _post(live_server, "/chat/completions",
                 {"model": MODEL, "messages": USER, "response_format": format_})  # fmt: skip
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert live_server.state.usage.query()["totals"]["requests"] == before  # never admitted


def test_bad_tool_choices_are_400s(live_server: LiveServer) -> None:
    cases = [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        # kvgate's own formats do not nest in the tool grammar (OpenAI's do: test_responses)
        ({"tools": [WEATHER], "response_format": {"type": "regex", "regex": "[a-z]+"}},
         "response_format"),
    ]  # fmt: skip
    for extra, param in cases:
        resp = _post(live_server, "/chat/completions",
                     {"model": MODEL, "messages": USER, **extra})  # fmt: skip
        assert resp.status_code == 400, (extra, resp.text)
        assert resp.json()["error"]["param"] == param
