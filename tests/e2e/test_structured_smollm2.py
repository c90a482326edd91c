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


def _jobs() -> list[tuple[str, dict[str, Any]]]:
    """(what, body): every schema, the regex and the choice, at t=0 and 1, streamed or not."""
    targets: list[tuple[str, dict[str, Any], str]] = [
        (name, {"type": "json_schema",
                "json_schema": {"name": name, "schema": entry["schema"], "strict": True}},
         entry["prompt"])
        for name, entry in SCHEMAS.items()
    ]  # fmt: skip
    targets.append(("regex", {"type": "regex", "regex": REGEX[0]}, REGEX[1]))
    targets.append(("choice", {"type": "choice", "choice": CHOICE[0]}, CHOICE[1]))
    jobs = []
    for temperature in (0.0, 1.0):
        for stream in (False, True):
            for name, fmt, prompt in targets:
                body = {
                    "temperature": temperature, "stream": stream, "seed": 7, "max_tokens": 400,
                    "response_format": fmt, "messages": [{"role": "user", "content": prompt}],
                }  # fmt: skip
                jobs.append((name, body))
    return jobs


def test_every_schema_regex_and_choice_validates_at_t0_and_t1(server: LiveServer) -> None:
    jobs = _jobs()
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
    # Any object is allowed, so a small model may also write one for ever (finish "length",
    # the documented end); asked for a small one, it closes it.
    ask = "Reply with a JSON object with the keys name and age of a cat."
    text, finish = _chat(server, {
        "messages": [{"role": "user", "content": ask}],
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
        result = json.dumps({"city": "Paris", "temperature_c": 18})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
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


def test_langchain_structured_output_and_bind_tools(server: LiveServer) -> None:
    """LangChain's two ways to get structured data, unchanged, against kvgate."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=30)

    llm = ChatOpenAI(
        base_url=server.api_url, api_key=API_KEY, model=MODEL, temperature=0, max_tokens=100,
        max_retries=0,
    )  # fmt: skip
    for method in ("json_schema", "function_calling"):
        cat = llm.with_structured_output(Cat, method=method).invoke("Name a cat and its age.")
        assert isinstance(cat, Cat), (method, cat)

    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="required").invoke("Weather in Rome?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
