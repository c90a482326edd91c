"""Structured output on the real SmolLM2-135M-Instruct, through the HTTP server: every output
of every test schema (nested objects, arrays, enums, bounded numbers, optional fields, string
patterns), regex and choice parses and validates, at temperature 0 and 1, streamed and not;
tool calling end to end with the ``openai`` client. Requests run concurrently, so constrained
rows share steps with each other."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvgate.config import EngineConfig
from kvgate.server.config import ServerConfig
from tests.server.conftest import API_KEY, MODEL, LiveServer, start_server

pytestmark = pytest.mark.slow

SCHEMAS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "schemas.json").read_text()
)
REGEX = (r"[A-Z][a-z]{2,12} is (sunny|rainy|cloudy) with [0-9]{1,2} degrees\.",
         "Describe the weather in one sentence.")  # fmt: skip
CHOICE = (["positive", "negative", "neutral"], "Is 'I loved it' positive, negative or neutral?")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(smollm2_gguf_path: Path) -> Iterator[LiveServer]:
    live = start_server(
        EngineConfig(model=str(smollm2_gguf_path), kv_cache_memory="512MiB", max_num_seqs=32),
        ServerConfig(served_model_name=MODEL),
    )
    yield live
    live.stop()


def _chat(server: LiveServer, body: dict[str, Any]) -> tuple[str, str]:
    """(text, finish_reason) of one chat, streamed or not."""
    url = f"{server.api_url}/chat/completions"
    headers = {"authorization": f"Bearer {API_KEY}"}
    resp = httpx.post(url, json={"model": MODEL, **body}, headers=headers, timeout=600)
    assert resp.status_code == 200, resp.text
    if not body.get("stream"):
        choice = resp.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, finish = "", ""
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                text += c["delta"].get("content") or ""
                finish = c["finish_reason"] or finish
    return text, finish


def test_every_schema_regex_and_choice_validates_at_t0_and_t1(server: LiveServer) -> None:
    jobs: list[tuple[str, dict[str, Any]]] = []
    for temperature in (0.0, 1.0):
        for stream in (False, True):
            common = {"temperature": temperature, "stream": stream, "seed": 7, "max_tokens": 400}
            for name, entry in SCHEMAS.items():
                fmt = {"type": "json_schema",
                       "json_schema": {"name": name, "schema": entry["schema"], "strict": True}}
                jobs.append((name, {**common, "response_format": fmt,
                             "messages": [{"role": "user", "content": entry["prompt"]}]}))  # fmt: skip
            jobs.append(("regex", {**common, "response_format": {"type": "regex", "regex": REGEX[0]},
                         "messages": [{"role": "user", "content": REGEX[1]}]}))  # fmt: skip
            jobs.append(("choice", {**common,
                         "response_format": {"type": "choice", "choice": CHOICE[0]},
                         "messages": [{"role": "user", "content": CHOICE[1]}]}))  # fmt: skip
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _chat(server, job[1]), jobs))
    failures = []
    for (name, body), (text, finish) in zip(jobs, results, strict=True):
        where = f"{name} t={body['temperature']} stream={body['stream']}: {text[:200]!r}"
        try:
            assert finish == "stop", f"finish {finish}"
            if name == "regex":
                assert re.fullmatch(REGEX[0], text)
            elif name == "choice":
                assert text in CHOICE[0]
            else:
                jsonschema.validate(json.loads(text), SCHEMAS[name]["schema"])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{where}: {exc}")
    assert not failures, "\n".join(failures)
    assert len(results) == 28


def test_json_object_closes_its_object(server: LiveServer) -> None:
    text, finish = _chat(server, {
        "messages": [{"role": "user", "content": "Give a JSON object describing a cat."}],
        "response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 300,
    })  # fmt: skip
    assert finish == "stop"
    assert isinstance(json.loads(text), dict)


def test_tool_call_round_trip_with_the_openai_client(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "What's the weather like in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
        temperature=0, max_tokens=100,
    )  # fmt: skip
    assert first.choices[0].finish_reason == "tool_calls"
    calls = first.choices[0].message.tool_calls or []
    assert len(calls) >= 1
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])  # type: ignore[index]
    assert calls[0].function.name == "get_weather"
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"city": "Paris", "temperature_c": 18})})  # fmt: skip
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto",  # type: ignore[list-item]
        temperature=0, max_tokens=60,
    )  # fmt: skip
    answer = second.choices[0]
    if answer.message.tool_calls:  # auto: a call is allowed, and then it validates
        for call in answer.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                WEATHER["function"]["parameters"])  # type: ignore[index]  # fmt: skip
    else:
        assert answer.message.content
        assert "<tool_call>" not in answer.message.content
    print("second turn:", answer.message.model_dump(exclude_none=True))
