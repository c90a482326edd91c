"""Request bodies of the OpenAI-compatible API, as pydantic models.

Strict types (a string where a number belongs is a 400, as with OpenAI), unknown fields
ignored (clients send fields of newer API versions). Ranges are checked here where OpenAI
documents them; the rest by ``SamplingParams``, whose errors name the parameter.
Responses are plain dicts built by the handlers: they are written once and never validated.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: Most choices one request may ask for (each is a sequence in the engine).
MAX_N = 16
#: Most tools one request may describe (each is in the prompt and the grammar).
MAX_TOOLS = 128


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class OtherPart(_Body):
    """Any non-text content part (image_url, input_audio, ...): parsed so it can be refused."""

    type: str


class ToolCallFunction(_Body):
    name: str
    arguments: str


class ToolCallItem(_Body):
    """A call an assistant turn made (``tool_calls`` of a message in the history)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None


class JsonSchemaFormat(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``text``, ``json_object`` and ``json_schema``; kvgate's ``regex`` (the whole
    output matches it), ``choice`` (the output is one of the strings) and ``grammar`` (a
    Lark grammar, as llguidance reads it)."""

    type: Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionSpec(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class _SamplingFields(_Body):
    """Fields shared by chat and completions (OpenAI's plus vLLM's common extensions)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    #: Seconds the request may take (kvgate): past it the request ends with what it has,
    #: finish_reason "deadline". Capped by the tenant's max_deadline; also x-request-timeout.
    timeout: Annotated[float, Field(gt=0)] | None = None
    # Extensions (vLLM's names).
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    #: Prefix-cache salt (vLLM's name): requests share cached prefixes only with requests of
    #: the same salt (and tenant); on an open server, the way to keep one's prompts' cache
    #: (and its timing) to oneself.
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    #: What the output must match (constrained decoding; ``kvgate/structured``).
    response_format: ResponseFormat | None = None
    #: Speculative decoding (kvgate): false opts this request out; true asks for it (a 400
    #: where the server was started without ``--speculative``); absent: the server's.
    speculative: bool | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool | None = None
    tools: Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[list[list[Annotated[int, Field(ge=0)]]], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
