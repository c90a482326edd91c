"""The client libraries agents are built on, end to end against kvgate on the tiny model: the
OpenAI Agents SDK (over ``/v1/responses`` and over chat completions), LangChain's
``ChatOpenAI`` (both APIs) and pydantic-ai (both APIs). Each runs its own loop: it sends
the tools and output formats its own way, parses kvgate's tool calls, runs the tool, sends
the result back and reads the final answer, whole or streamed.

The random weights write gibberish, but every tool call and every structured answer is valid
by construction (constrained decoding), so whatever the library must parse, it can. Sampling
is greedy (``temperature=0``: the fp32 model's output is exactly reproducible) and one call
a turn, and where the model may still choose (a call or an answer) the tests assert what
holds either way. The tools' arguments are bounded (a string's length, a number's range): an
unbounded string from random weights may not end within the token budget.

``Exchanges`` records what each library sent and what kvgate refused, so a failure shows the
exchange and not only the library's own exception."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import operator
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import agents
import httpx2
import openai
import pydantic_ai
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field, SecretStr
from pydantic_ai.messages import AgentStreamEvent
from pydantic_ai.models import Model as PydanticAIModel
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.server.conftest import MODEL, LiveServer, start_tenants_server

KEY = "sk-agents"
TENANTS = f"""
[tenants.agents]
keys = ["{KEY}"]
"""

T = TypeVar("T")

City = Annotated[str, Field(max_length=12, description="The city")]
Days = Annotated[int, Field(ge=1, le=7, description="How many days ahead")]


class Forecast(BaseModel):
    """The answer an agent must give: a yes/no and one of a few words."""

    sunny: bool
    wind: Literal["calm", "breezy", "stormy"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # Agents' prompts are long (instructions, every tool's schema, the turns so far).
    live = start_tenants_server(
        tiny_llama_dir, TENANTS, tmp_path_factory.mktemp("agents"),
        engine={"max_model_len": 2048, "kv_cache_memory": "128MiB"},
    )  # fmt: skip
    yield live
    live.stop()


class Exchanges:
    """The requests a library sent (their JSON bodies) and kvgate's refusals, through the
    event hooks of the HTTP clients it is given."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.log: list[str] = []
        self.clients: list[httpx2.AsyncClient] = []
        self.sync_clients: list[httpx2.Client] = []

    def _request(self, request: httpx2.Request) -> None:
        self.requests.append(json.loads(request.content) if request.content else {})
        self.log.append(f"> {request.method} {request.url.path} {request.content.decode()}")

    def _refused(self, response: httpx2.Response) -> None:
        self.log.append(f"< {response.status_code} {response.text}")

    def http_client(self) -> httpx2.AsyncClient:
        async def request(request: httpx2.Request) -> None:
            self._request(request)

        async def response(response: httpx2.Response) -> None:
            if response.status_code >= 400:
                await response.aread()
                self._refused(response)

        hooks: dict[str, list[Callable[..., Any]]] = {"request": [request], "response": [response]}
        client = httpx2.AsyncClient(event_hooks=hooks, timeout=120)
        self.clients.append(client)
        return client

    def sync_http_client(self) -> httpx2.Client:
        def response(response: httpx2.Response) -> None:
            if response.status_code >= 400:
                response.read()
                self._refused(response)

        client = httpx2.Client(event_hooks={"request": [self._request], "response": [response]})
        self.sync_clients.append(client)
        return client

    def run(self, main: Callable[[], Awaitable[T]]) -> T:
        """``main`` on an event loop of its own (the test's async clients live on it and are
        closed with it); a failure shows the exchange."""

        async def closing() -> T:
            try:
                return await main()
            finally:
                for client in self.clients:
                    await client.aclose()

        with self.explained():
            return asyncio.run(closing())

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """A library's exception (not a test's assertion) shows the exchange that led to it."""
        try:
            yield
        except AssertionError:
            raise
        except Exception as e:
            raise AssertionError("\n".join(["the exchange:", *self.log])) from e


@pytest.fixture
def exchanges() -> Iterator[Exchanges]:
    exchanges = Exchanges()
    yield exchanges
    for client in exchanges.sync_clients:
        client.close()


def _async_openai(live: LiveServer, exchanges: Exchanges) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=live.api_url, api_key=KEY, max_retries=0, http_client=exchanges.http_client()
    )


# --- The OpenAI Agents SDK --------------------------------------------------------------

SDK_MODELS = ["responses", "chat"]


def _sdk_model(kind: str, client: openai.AsyncOpenAI) -> agents.Model:
    agents.set_tracing_disabled(True)
    if kind == "responses":
        return agents.OpenAIResponsesModel(MODEL, client)
    return agents.OpenAIChatCompletionsModel(MODEL, client)


async def _sdk_run(
    agent: agents.Agent[Any], stream: bool, max_turns: int, **kwargs: Any
) -> agents.RunResult | agents.RunResultStreaming:
    if not stream:
        return await agents.Runner.run(agent, "Forecast for Oslo?", max_turns=max_turns, **kwargs)
    streamed = agents.Runner.run_streamed(
        agent, "Forecast for Oslo?", max_turns=max_turns, **kwargs
    )
    async for _ in streamed.stream_events():
        pass
    return streamed


def _sdk_calls(result: agents.RunResult | agents.RunResultStreaming) -> list[dict[str, Any]]:
    """The arguments of the tool calls the run made, as the SDK read them from kvgate."""
    items = [i for i in result.new_items if isinstance(i, agents.ToolCallItem)]
    return [json.loads(i.raw_item.arguments) for i in items]  # type: ignore[union-attr]


def _forecaster(model: agents.Model, first: str, calls: list[str]) -> agents.Agent[Any]:
    """An agent with a wind tool (each call's city goes to ``calls``) and ``Forecast`` as
    its output type, greedy, ``first`` as its tool choice."""

    @agents.function_tool
    def get_wind(city: City) -> str:
        """The wind in a city."""
        calls.append(city)
        return "calm"

    return agents.Agent(
        name="forecaster",
        instructions="Tell whether it is sunny and how windy.",
        model=model,
        tools=[get_wind],
        output_type=Forecast,
        model_settings=agents.ModelSettings(
            tool_choice=first, temperature=0, max_tokens=200, parallel_tool_calls=False
        ),
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", SDK_MODELS)
def test_agents_sdk_runs_a_required_tool(
    server: LiveServer, exchanges: Exchanges, kind: str, stream: bool
) -> None:
    calls: list[tuple[str, int]] = []

    @agents.function_tool
    def get_weather(city: City, days: Days) -> str:
        """The weather in a city for the next days."""
        calls.append((city, days))
        return f"sunny in {city}"

    async def main() -> agents.RunResult | agents.RunResultStreaming:
        agent = agents.Agent(
            name="forecaster",
            instructions="Answer with the weather tool.",
            model=_sdk_model(kind, _async_openai(server, exchanges)),
            tools=[get_weather],
            model_settings=agents.ModelSettings(
                tool_choice="required", max_tokens=200, temperature=0, parallel_tool_calls=False
            ),
            tool_use_behavior="stop_on_first_tool",
        )
        return await _sdk_run(agent, stream, max_turns=2)

    result = exchanges.run(main)
    # The SDK read kvgate's call into the function's arguments and ran it, once; its result
    # is the run's.
    ((city, days),) = calls
    assert isinstance(city, str) and len(city) <= 12 and 1 <= days <= 7
    assert result.final_output == f"sunny in {city}"
    assert _sdk_calls(result) == [{"city": city, "days": days}]
    assert len(exchanges.requests) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("first", ["auto", "required"])
@pytest.mark.parametrize("kind", SDK_MODELS)
def test_agents_sdk_gives_a_structured_answer_beside_a_tool(
    server: LiveServer,
    exchanges: Exchanges,
    kind: str,
    first: Literal["auto", "required"],
    stream: bool,
) -> None:
    """The format and a tool together (``text.format`` or ``response_format`` beside
    ``tools``): each turn is a call or an answer in the format; the run ends on an answer,
    after the calls (if any) the SDK ran. ``required`` forces a call first (the SDK then
    resets the choice to auto), so the loop goes on past a tool's result."""
    calls: list[str] = []

    async def main() -> agents.RunResult | agents.RunResultStreaming:
        agent = _forecaster(_sdk_model(kind, _async_openai(server, exchanges)), first, calls)
        return await _sdk_run(agent, stream, max_turns=4)

    result = exchanges.run(main)
    assert isinstance(result.final_output, Forecast)
    assert [{"city": c} for c in calls] == _sdk_calls(result)
    assert len(exchanges.requests) == len(calls) + 1
    if first == "required":
        assert calls


def test_agents_sdk_runs_a_required_tool_when_sampled(
    server: LiveServer, exchanges: Exchanges
) -> None:
    """As ``test_agents_sdk_runs_a_required_tool`` but sampled (a seed: reproducible): a
    call of ~30 tokens, 200 allowed. Found by this test: whitespace before the call was
    unbounded, and this seed spent all 200 tokens on it (no call; the SDK ended the run
    on the whitespace); now a few characters at most (``tools.tool_grammar``)."""
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: City, days: Days) -> str:
        """The weather in a city for the next days."""
        calls.append(city)
        return f"sunny in {city}"

    async def main() -> agents.RunResult | agents.RunResultStreaming:
        agent = agents.Agent(
            name="forecaster",
            instructions="Answer with the weather tool.",
            model=_sdk_model("chat", _async_openai(server, exchanges)),
            tools=[get_weather],
            model_settings=agents.ModelSettings(
                tool_choice="required",
                max_tokens=200,
                temperature=1.0,
                parallel_tool_calls=False,
                extra_args={"seed": 18},
            ),
            tool_use_behavior="stop_on_first_tool",
        )
        return await _sdk_run(agent, stream=False, max_turns=2)

    result = exchanges.run(main)
    assert len(calls) == 1, repr(result.final_output)


def test_agents_sdk_chains_turns_by_previous_response_id(
    server: LiveServer, exchanges: Exchanges
) -> None:
    """``auto_previous_response_id``: after the first turn the SDK sends only the new items
    and names the stored response they follow (kvgate continues its conversation)."""
    calls: list[str] = []

    async def main() -> agents.RunResult | agents.RunResultStreaming:
        model = _sdk_model("responses", _async_openai(server, exchanges))
        agent = _forecaster(model, "required", calls)
        return await _sdk_run(agent, stream=True, max_turns=4, auto_previous_response_id=True)

    result = exchanges.run(main)
    assert isinstance(result.final_output, Forecast)
    assert calls and len(exchanges.requests) == len(calls) + 1
    first, *later = exchanges.requests
    assert "previous_response_id" not in first
    assert [r["previous_response_id"] for r in later] == [
        r.response_id for r in result.raw_responses[:-1]
    ]
    for request in later:  # the tool's result only: the rest is kvgate's stored conversation
        assert [i["type"] for i in request["input"]] == ["function_call_output"]


# --- LangChain ---------------------------------------------------------------------------


class GetWeather(BaseModel):
    """The weather in a city for the next days."""

    city: City
    days: Days


LANGCHAIN_APIS: dict[str, dict[str, Any]] = {
    "chat": {},
    "responses": {"use_responses_api": True},
    # Only the new messages go, after the id of the stored response they follow.
    "responses-chained": {"use_responses_api": True, "use_previous_response_id": True},
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", LANGCHAIN_APIS)
def test_langchain_tool_call_round_trip(
    server: LiveServer, exchanges: Exchanges, api: str, stream: bool
) -> None:
    def chat(max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(
            model=MODEL,
            base_url=server.api_url,
            api_key=SecretStr(KEY),
            max_retries=0,
            temperature=0,
            max_completion_tokens=max_tokens,
            http_client=exchanges.sync_http_client(),
            **LANGCHAIN_APIS[api],
        )

    def ask(llm: Any, messages: list[BaseMessage]) -> AIMessage:
        if not stream:
            message = llm.invoke(messages)
        else:
            message = functools.reduce(operator.add, llm.stream(messages))
        assert isinstance(message, AIMessage)
        return message

    question = HumanMessage("Weather in Oslo?")
    with exchanges.explained():
        # Default tools (not strict): the arguments come back parsed all the same.
        bound = chat(200).bind_tools(
            [GetWeather], tool_choice="required", parallel_tool_calls=False
        )
        called = ask(bound, [question])
        assert not called.invalid_tool_calls
        (call,) = called.tool_calls
        assert call["name"] == "GetWeather" and call["id"]
        args = GetWeather.model_validate(call["args"])  # of the tool's types and bounds
        # The tool's result goes back and the model answers (in text: a few tokens).
        result = ToolMessage(f"Sunny in {args.city}", tool_call_id=call["id"])
        answer = ask(
            chat(6).bind_tools([GetWeather], tool_choice="none"), [question, called, result]
        )
    assert not answer.tool_calls and not answer.invalid_tool_calls and answer.text
    first, second = exchanges.requests
    assert "strict" not in json.dumps(first["tools"])
    if api == "responses-chained":
        assert second["previous_response_id"] == called.response_metadata["id"]


# --- pydantic-ai --------------------------------------------------------------------------

PYDANTIC_AI_MODELS = ["chat", "responses"]


def _pydantic_ai_model(kind: str, live: LiveServer, exchanges: Exchanges) -> PydanticAIModel:
    provider = OpenAIProvider(
        base_url=live.api_url, api_key=KEY, http_client=exchanges.http_client()
    )
    if kind == "chat":
        return OpenAIChatModel(MODEL, provider=provider)
    return OpenAIResponsesModel(MODEL, provider=provider)


def _weather_tool(calls: list[tuple[str, int]]) -> pydantic_ai.Tool[None]:
    def get_weather(city: City, days: Days) -> str:
        """The weather in a city for the next days."""
        calls.append((city, days))
        return "sunny"

    return pydantic_ai.Tool(get_weather)


def _settings(tool_choice: Any) -> pydantic_ai.ModelSettings:
    return {"tool_choice": tool_choice, "max_tokens": 200, "temperature": 0,
            "parallel_tool_calls": False}  # fmt: skip


@pytest.mark.parametrize("kind", PYDANTIC_AI_MODELS)
def test_pydantic_ai_calls_a_tool_then_answers_with_its_output_tool(
    server: LiveServer, exchanges: Exchanges, kind: str
) -> None:
    calls: list[tuple[str, int]] = []

    def settings(ctx: pydantic_ai.RunContext[None]) -> pydantic_ai.ModelSettings:
        # The first request must call the weather tool (by name: pydantic-ai's "required"
        # lets the output tool be called too); the next must give the answer, which is a call
        # of the output tool pydantic-ai declares for a structured output: a deterministic run.
        return _settings(["get_weather"] if ctx.run_step <= 1 else ["final_result"])

    agent = pydantic_ai.Agent(
        _pydantic_ai_model(kind, server, exchanges),
        output_type=Forecast,
        tools=[_weather_tool(calls)],
        model_settings=settings,
    )
    result = exchanges.run(lambda: agent.run("Forecast for Oslo?"))
    assert isinstance(result.output, Forecast)
    ((city, days),) = calls
    assert isinstance(city, str) and len(city) <= 12 and 1 <= days <= 7
    assert len(exchanges.requests) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", PYDANTIC_AI_MODELS)
def test_pydantic_ai_native_output_beside_a_tool(
    server: LiveServer, exchanges: Exchanges, kind: str, stream: bool
) -> None:
    calls: list[tuple[str, int]] = []
    events: list[str] = []

    def settings(ctx: pydantic_ai.RunContext[None]) -> pydantic_ai.ModelSettings:
        # A call first, then the answer in the response format (no tools allowed).
        return _settings("required" if ctx.run_step <= 1 else "none")

    async def handler(
        ctx: pydantic_ai.RunContext[None], streamed: AsyncIterable[AgentStreamEvent]
    ) -> None:
        async for event in streamed:
            events.append(event.event_kind)

    agent = pydantic_ai.Agent(
        _pydantic_ai_model(kind, server, exchanges),
        output_type=pydantic_ai.NativeOutput(Forecast),
        tools=[_weather_tool(calls)],
        model_settings=settings,
    )
    result = exchanges.run(
        lambda: agent.run("Forecast for Oslo?", event_stream_handler=handler if stream else None)
    )
    assert isinstance(result.output, Forecast)
    assert len(calls) == 1 and len(exchanges.requests) == 2
    if stream:
        assert all(r.get("stream") for r in exchanges.requests)
        assert "function_tool_call" in events and "function_tool_result" in events
