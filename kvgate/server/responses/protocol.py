"""The request body of ``POST /v1/responses``, as pydantic models (OpenAI's shape).

Strict types and unknown fields ignored, as the chat endpoints' bodies
(``server/protocol.py``). Input items are read by their ``type``: a message (``type`` may
be left out, as OpenAI allows), a function call the model made, its output, a
``file_search_call`` (context only: kvgate searches again), a ``reasoning`` item (dropped:
no served model writes one). What kvgate cannot read (images, files, item references) is a
400 that names the item.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from kvgate.server.protocol import MAX_TOOLS

#: Most input items one request may send (messages and tool calls with their outputs).
MAX_ITEMS = 2048


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class InputText(_Body):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @property
    def value(self) -> str:
        return self.text if self.text is not None else self.refusal or ""


class OtherContent(_Body):
    """A content part kvgate cannot read (``input_image``, ``input_file``, ...): parsed so
    it can be refused by name."""

    type: str


def _part_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text" if kind in ("input_text", "output_text", "text", "refusal") else "other"


Part = Annotated[
    Annotated[InputText, Tag("text")] | Annotated[OtherContent, Tag("other")],
    Discriminator(_part_kind),
]


class InputMessage(_Body):
    type: Literal["message"] | None = None
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    id: str | None = None
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str


class FunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[Part]


class ContextItem(_Body):
    """An item that is context only: a search the server made, reasoning the model wrote."""

    type: Literal["file_search_call", "reasoning"]
    id: str | None = None


class OtherItem(_Body):
    """Any other item type: parsed so it can be refused by name."""

    type: str


_ITEM_TAGS = {
    None: "message", "message": "message", "function_call": "function_call",
    "function_call_output": "function_call_output", "file_search_call": "context",
    "reasoning": "context",
}  # fmt: skip


def _item_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _ITEM_TAGS.get(kind, "other") if isinstance(kind, (str, type(None))) else "other"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")]
    | Annotated[ContextItem, Tag("context")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]


class FunctionTool(_Body):
    """A function the model may call (Responses' flat shape: no ``function`` wrapper)."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class RankingOptions(_Body):
    #: OpenAI's rankers are the retriever's own order here; ``kvgate-llm``: reranked by
    #: the served model (server/rerank.py).
    ranker: Literal["auto", "default-2024-11-15", "none", "kvgate-llm"] | None = None
    score_threshold: Annotated[float, Field(ge=0, le=1)] | None = None


class FileSearchTool(_Body):
    type: Literal["file_search"]
    vector_store_ids: Annotated[list[str], Field(min_length=1, max_length=16)]
    #: 5, not 8 with neighbours: measured with Qwen2.5-1.5B on the 30 development questions
    #: (docs/user/documents.md), the same answers from half the prompt, sooner, better cited.
    max_num_results: Annotated[int, Field(ge=1, le=50)] = 5
    filters: dict[str, Any] | None = None
    ranking_options: RankingOptions | None = None


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class HostedToolChoice(_Body):
    """``{"type": "file_search"}``: the search runs (it always does when the tool is given)."""

    type: Literal["file_search"]


ToolChoice = Literal["none", "auto", "required"] | NamedFunctionChoice | HostedToolChoice


class TextFormat(_Body):
    """``text.format``: free text, any JSON object, or JSON valid against ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(_Body):
    """Accepted and ignored: no served model reasons apart from its answer."""

    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    include: list[str] | None = None
    #: Kept for ``GET /v1/responses/{id}`` (default true, as OpenAI's).
    store: bool | None = None
    #: Answer at once with the response ``queued``; poll ``GET``, ``POST .../cancel``.
    background: bool | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    #: OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512.
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    #: kvgate's: ``extract`` quotes the best clause verbatim before the model's answer.
    answer_mode: Literal["generate", "extract"] = "generate"
    #: kvgate's: the best ``expand_top`` sources go into the prompt with up to
    #: ``expand_neighbours`` chunks on each side under the same heading (context expansion);
    #: off by default: a small model quotes the neighbours under the hit's label.
    expand_neighbours: Annotated[int, Field(ge=0, le=3)] = 0
    expand_top: Annotated[int, Field(ge=0, le=50)] = 3

    @property
    def stored(self) -> bool:
        return self.store is not False
