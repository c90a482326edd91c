"""``/v1/responses`` end to end on the tiny model: function tools (whole and streamed, with
OpenAI's event sequence), ``text.format``, tools beside a format, stored responses with
their tenant's ownership and quota, ``previous_response_id`` chains over the prefix cache,
background responses and their cancel, and what is refused."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.server.conftest import MODEL, LiveServer, start_tenants_server

TENANTS = """
admin_keys = ["sk-admin"]

[tenants.alpha]
keys = ["sk-alpha"]

[tenants.beta]
keys = ["sk-beta"]
max_stored_responses = 2

[tenants.gamma]
keys = ["sk-gamma"]
"""

EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
    },
}  # fmt: skip
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_tenants_server(tiny_llama_dir, TENANTS, tmp_path_factory.mktemp("responses"))
    yield live
    live.stop()


def _client(live: LiveServer, key: str = "sk-alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=live.api_url, api_key=key, max_retries=0)


def _post(live: LiveServer, body: dict[str, Any], key: str = "sk-alpha") -> httpx.Response:
    return httpx.post(f"{live.api_url}/responses", json={"model": MODEL, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip


def _events(live: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events, each its data with the ``event:`` name checked against it."""
    events = []
    with httpx.stream("POST", f"{live.api_url}/responses",
                      json={"model": MODEL, "stream": True, **body},
                      headers={"Authorization": "Bearer sk-alpha"}, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    for event in events:  # every event as the openai client's types require it
        EVENTS.validate_python(event)
    return events


def test_a_function_tool_is_called_whole(server: LiveServer) -> None:
    client = _client(server)
    response = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required", temperature=0, max_output_tokens=200,
    )  # fmt: skip
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.usage is not None and response.usage.output_tokens > 0
    # Stored by default, as OpenAI's: the same object comes back.
    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()
    (item,) = client.responses.input_items.list(response.id).data
    assert item.type == "message" and item.role == "user"  # type: ignore[union-attr]


def test_a_named_function_and_its_output_round_trip(server: LiveServer) -> None:
    client = _client(server)
    first = client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
    )  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call"
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]  # fmt: skip
    second = client.responses.create(
        model=MODEL, input=items, tools=[WEATHER], tool_choice="none",  # type: ignore[arg-type,list-item]
        max_output_tokens=5,
    )  # fmt: skip
    assert [o.type for o in second.output] == ["message"]
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    listed = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in listed] == ["message", "function_call", "function_call_output"]


def test_streamed_function_calls_follow_openais_events(server: LiveServer) -> None:
    events = _events(server, {"input": "Weather?", "tools": [WEATHER], "tool_choice": "required",
                              "max_output_tokens": 200, "parallel_tool_calls": False})  # fmt: skip
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    added = events[2]["item"]
    assert added["type"] == "function_call" and added["status"] == "in_progress"
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert deltas and "".join(d["delta"] for d in deltas) == done["arguments"]
    assert all(d["item_id"] == added["id"] for d in deltas)
    assert kinds[-3:-1] == ["response.function_call_arguments.done", "response.output_item.done"]
    final = events[-1]["response"]
    (call,) = final["output"]
    assert call["arguments"] == done["arguments"] and call["call_id"] == added["call_id"]
    assert not any(k.startswith("response.output_text") for k in kinds)


def test_a_call_cut_by_max_output_tokens_is_incomplete(server: LiveServer) -> None:
    body = {"input": "Weather?", "tools": [WEATHER], "tool_choice": "required",
            "max_output_tokens": 22, "temperature": 0}  # fmt: skip
    whole = _post(server, body).json()
    assert whole["status"] == "incomplete"
    (call,) = whole["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete"
    events = _events(server, body)
    (done,) = [e for e in events if e["type"] == "response.output_item.done"]
    assert done["item"]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"


def test_streamed_text_follows_openais_events(server: LiveServer) -> None:
    events = _events(server, {"input": "Say hi", "max_output_tokens": 8, "temperature": 0})
    kinds = [e["type"] for e in events]
    assert kinds[:5] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
    ]  # fmt: skip
    assert kinds[-5:] == [
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    stored = httpx.get(f"{server.api_url}/responses/{final['id']}",
                       headers={"Authorization": "Bearer sk-alpha"}).json()  # fmt: skip
    assert stored == final  # a streamed response is stored as it ended
    Response.model_validate(final)
    assert final["output"][0]["status"] == "incomplete"  # the message was cut too
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == 8


class Answer(BaseModel):
    ok: bool
    n: int


def test_text_format_constrains_the_answer(server: LiveServer) -> None:
    client = _client(server)
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    response = client.responses.create(
        model=MODEL, input="Answer", text={"format": fmt}, max_output_tokens=40,  # type: ignore[typeddict-item]
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    assert response.text.format.type == "json_schema"  # type: ignore[union-attr]
    obj = client.responses.create(
        model=MODEL, input="Answer", text={"format": {"type": "json_object"}}, max_output_tokens=40
    )
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)
    parsed = client.responses.parse(
        model=MODEL, input="Answer", text_format=Answer, max_output_tokens=40
    )
    assert isinstance(parsed.output_parsed, Answer)


@pytest.mark.parametrize("seed", range(4))
def test_tools_beside_a_format_give_a_call_or_an_answer_in_it(
    server: LiveServer, seed: int
) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER}
    body = {"input": f"question {seed}", "tools": [WEATHER], "text": {"format": fmt},
            "max_output_tokens": 200, "temperature": 1.0}  # fmt: skip
    r = _post(server, body)
    assert r.status_code == 200, r.text
    for item in r.json()["output"]:
        if item["type"] == "function_call":
            jsonschema.validate(json.loads(item["arguments"]), WEATHER["parameters"])
        else:
            jsonschema.validate(json.loads(item["content"][0]["text"]), ANSWER)
    # Chat takes the same pair (OpenAI does): a tool call or content in the format.
    chat = httpx.post(
        f"{server.api_url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": f"q{seed}"}],
              "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                          if k != "type"}}],
              "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "a", "schema": ANSWER}},
              "max_tokens": 200},
        headers={"Authorization": "Bearer sk-alpha"}, timeout=60,
    )  # fmt: skip
    assert chat.status_code == 200, chat.text
    message = chat.json()["choices"][0]["message"]
    if message.get("tool_calls"):
        jsonschema.validate(json.loads(message["tool_calls"][0]["function"]["arguments"]),
                            WEATHER["parameters"])  # fmt: skip
    else:
        jsonschema.validate(json.loads(message["content"]), ANSWER)


def test_stored_responses_belong_to_their_tenant(server: LiveServer) -> None:
    alpha, beta, admin = (_client(server, k) for k in ("sk-alpha", "sk-beta", "sk-admin"))
    made = alpha.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.input_items.list(made.id)
    with pytest.raises(openai.NotFoundError):  # nor may it continue another's conversation
        beta.responses.create(model=MODEL, input="x", previous_response_id=made.id)
    assert admin.responses.retrieve(made.id).id == made.id
    with pytest.raises(openai.AuthenticationError):  # an admin key does no work itself
        admin.responses.create(model=MODEL, input="x", previous_response_id=made.id)
    unstored = alpha.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(unstored.id)
    alpha.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        admin.responses.retrieve(made.id)


def test_the_stored_responses_quota(server: LiveServer) -> None:
    beta = _client(server, "sk-beta")  # max_stored_responses = 2
    kept = [beta.responses.create(model=MODEL, input="x", max_output_tokens=1) for _ in range(2)]
    with pytest.raises(openai.BadRequestError) as refused:
        beta.responses.create(model=MODEL, input="x", max_output_tokens=1)
    assert refused.value.code == "storage_quota_exceeded"
    assert "max_stored_responses" not in refused.value.message and "store: false" in (
        refused.value.message
    )
    beta.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
    beta.responses.delete(kept[0].id)
    beta.responses.create(model=MODEL, input="x", max_output_tokens=1)


def test_a_chain_continues_over_the_prefix_cache(server: LiveServer) -> None:
    client = _client(server)
    words = " ".join(f"word{i}" for i in range(60))  # several KV blocks of prompt
    first = client.responses.create(model=MODEL, input=words, max_output_tokens=4)
    second = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=4
    )
    assert second.previous_response_id == first.id
    u1, u2 = first.usage, second.usage
    assert u1 is not None and u2 is not None
    # The earlier turn (its input and its answer) is in the prompt, and read from the cache.
    assert u2.input_tokens > u1.input_tokens
    assert u2.input_tokens_details.cached_tokens >= 32
    third = client.responses.create(
        model=MODEL, input="More?", previous_response_id=second.id, max_output_tokens=2
    )
    assert third.usage is not None and third.usage.input_tokens > u2.input_tokens
    # Only its own input is listed for each.
    assert len(client.responses.input_items.list(third.id).data) == 1


def _poll(client: openai.OpenAI, response_id: str) -> Any:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        time.sleep(0.05)
    raise AssertionError("the background response did not finish")


def test_background_responses_are_polled(server: LiveServer) -> None:
    client = _client(server)
    made = client.responses.create(model=MODEL, input="hi", background=True, max_output_tokens=200,
                                   tools=[WEATHER], tool_choice="required")  # type: ignore[list-item]  # fmt: skip
    assert made.status in ("queued", "in_progress") and made.background is True
    done = _poll(client, made.id)
    assert done.status == "completed" and done.output[0].type == "function_call"
    assert done.usage is not None and done.usage.output_tokens > 0
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(
            client.responses.create(model=MODEL, input="x", max_output_tokens=1).id
        )
    # Cancelling a finished one returns it as it is.
    assert client.responses.cancel(made.id).status == "completed"


def test_a_background_response_is_cancelled(server: LiveServer) -> None:
    client = _client(server)
    made = client.responses.create(model=MODEL, input="tell a long story", background=True,
                                   max_output_tokens=400)  # fmt: skip
    cancelled = client.responses.cancel(made.id)
    # It may have finished before the cancel reached it (a fast machine): then it says so.
    assert cancelled.status in ("cancelled", "completed", "incomplete")
    assert client.responses.retrieve(made.id).status == cancelled.status
    if cancelled.status == "cancelled":
        assert cancelled.usage is not None and cancelled.usage.output_tokens < 400
        assert cancelled.usage.input_tokens > 0
        if cancelled.usage.output_tokens:  # what it had made is kept, cut
            assert [o.status for o in cancelled.output] == ["incomplete"]


def test_what_responses_refuse(server: LiveServer) -> None:
    bad = [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": "x", "background": True, "store": False}, "store"),
        ({"input": "x", "background": True, "stream": True}, "stream"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
         "text.format.schema"),
    ]  # fmt: skip
    for body, param in bad:
        r = _post(server, body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    missing = _post(server, {"input": "x", "previous_response_id": "resp_nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(f"{server.api_url}/responses/resp_nope",
                     headers={"Authorization": "Bearer sk-alpha"}).status_code == 404  # fmt: skip
    # Reasoning is accepted and ignored (no served model reasons apart from its answer).
    ok = _post(server, {"input": "x", "reasoning": {"effort": "low"}, "max_output_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_response_ids_are_the_servers_not_the_clients_request_id(server: LiveServer) -> None:
    ids = set()
    for key in ("sk-alpha", "sk-gamma"):
        r = httpx.post(f"{server.api_url}/responses",
                       json={"model": MODEL, "input": "x", "max_output_tokens": 1, "store": True},
                       headers={"Authorization": f"Bearer {key}", "x-request-id": "same-id"},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "same-id"  # the log's name for it
        ids.add(r.json()["id"])
        httpx.delete(f"{server.api_url}/responses/{r.json()['id']}",
                     headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert len(ids) == 2 and not any("same-id" in i for i in ids)


def test_a_stream_whose_client_leaves_is_stored_as_failed(server: LiveServer) -> None:
    with httpx.stream("POST", f"{server.api_url}/responses",
                      json={"model": MODEL, "input": "tell a long story", "stream": True,
                            "max_output_tokens": 400},
                      headers={"Authorization": "Bearer sk-alpha"}, timeout=60) as r:  # fmt: skip
        lines = r.iter_lines()
        created = None
        for line in lines:
            if line.startswith("data: "):
                created = json.loads(line[len("data: ") :])["response"]["id"]
                break
    assert created is not None  # the client left after the first event
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = httpx.get(f"{server.api_url}/responses/{created}",
                        headers={"Authorization": "Bearer sk-alpha"}).json()  # fmt: skip
        if got["status"] != "in_progress":
            break
        time.sleep(0.05)
    # It ended one way or the other (a fast machine may finish before the client's close
    # is seen): never left in_progress.
    assert got["status"] in ("failed", "incomplete"), got["status"]
    if got["status"] == "failed":
        assert "client" in got["error"]["message"]
