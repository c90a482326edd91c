"""A Responses request in chat's terms: its input items as chat messages, its function
tools, ``tool_choice`` and ``text.format`` as chat's fields, so one path (the chat
template, ``chat_constraints``, the tool-call grammar and reader) serves both APIs.

And the other way: the items as ``GET /v1/responses/{id}/input_items`` lists them (each
with an id), and a stored response's output items back as input for the next turn of a
``previous_response_id`` chain.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from typing import Any

from kvgate.errors import InvalidRequest
from kvgate.server.responses.protocol import (
    ContextItem,
    FunctionCallItem,
    FunctionCallOutput,
    FunctionTool,
    InputMessage,
    InputText,
    NamedFunctionChoice,
    OtherContent,
    Part,
    ResponsesRequest,
    ToolChoice,
)

#: An input item that is part of the conversation.
Turn = InputMessage | FunctionCallItem | FunctionCallOutput


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text(parts: str | Sequence[Part], param: str) -> str:
    if isinstance(parts, str):
        return parts
    for i, part in enumerate(parts):
        if isinstance(part, OtherContent):
            raise InvalidRequest(
                f"content of type {part.type!r} is not supported (kvgate serves text models)",
                param=f"{param}[{i}].type",
            )
    return "".join(p.value for p in parts if isinstance(p, InputText))


def input_items(
    body: ResponsesRequest,
) -> list[Turn]:
    """The request's own input as items (a string is one user message); context items
    (a search's record, reasoning) are dropped; what cannot be read is a 400."""
    if isinstance(body.input, str):
        return [InputMessage(role="user", content=body.input)]
    items: list[Turn] = []
    for i, item in enumerate(body.input):
        if isinstance(item, InputMessage | FunctionCallItem | FunctionCallOutput):
            items.append(item)
        elif not isinstance(item, ContextItem):
            raise InvalidRequest(
                f"input item of type {item.type!r} is not supported (messages, function_call "
                "and function_call_output are; item_reference: chain with "
                "previous_response_id)",
                param=f"input[{i}].type",
            )
    return items


def chat_messages(
    items: Iterable[Turn],
) -> list[dict[str, Any]]:
    """Chat messages of the items: a run of function calls joins the assistant turn before
    it (or makes one), each output is a ``tool`` turn."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if isinstance(item, InputMessage):
            text = _text(item.content, f"{param}.content")
            messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = _text(item.output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def function_tools(body: ResponsesRequest) -> list[FunctionTool]:
    """The request's function tools (``file_search`` is read by ``file_search.py``)."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        kind = tool.get("type")
        if kind == "function":
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValueError as exc:
                raise InvalidRequest(f"invalid function tool: {exc}", param=f"tools[{i}]") from None
        elif kind != "file_search":
            raise InvalidRequest(
                f"tool type {kind!r} is not supported on /v1/responses (function and "
                "file_search are)",
                param=f"tools[{i}].type",
            )
    return tools


def chat_tools(tools: Sequence[FunctionTool]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
        for t in tools
    ]


def chat_tool_choice(choice: ToolChoice | None, functions: bool) -> Any:
    """Chat's ``tool_choice``; a hosted tool's choice (file_search) leaves functions at
    ``auto``; ``required`` with only file_search is met by the search itself."""
    if isinstance(choice, NamedFunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if choice is None or not isinstance(choice, str) or not functions:
        return None
    return choice


def response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise InvalidRequest(
            "text.format of type json_schema needs its schema", param="text.format.schema"
        )
    inner: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.json_schema}
    if fmt.strict is not None:
        inner["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": inner}


def listed(
    items: Iterable[Turn],
) -> list[dict[str, Any]]:
    """The items as ``input_items`` lists them: each with an id (its own, else a new one)."""
    out = []
    for item in items:
        if isinstance(item, InputMessage):
            content = (
                [{"type": "input_text", "text": item.content}]
                if isinstance(item.content, str)
                else [p.model_dump(exclude_none=True) for p in item.content]
            )
            out.append({"id": item.id or new_id("msg"), "type": "message", "role": item.role,
                        "content": content, "status": "completed"})  # fmt: skip
        else:
            out.append({**item.model_dump(exclude_none=True), "id": item.id or new_id(
                "fc" if isinstance(item, FunctionCallItem) else "fco")})  # fmt: skip
    return out


def from_output(output: Sequence[dict[str, Any]]) -> list[InputMessage | FunctionCallItem]:
    """A stored response's output items as the next turn's input: its messages' text and its
    function calls (the search's record is dropped: the next turn searches again)."""
    items: list[InputMessage | FunctionCallItem] = []
    for item in output:
        if item.get("type") == "message":
            text = "".join(p.get("text") or p.get("refusal") or "" for p in item.get("content", []))
            items.append(InputMessage(role="assistant", content=text))
        elif item.get("type") == "function_call":
            items.append(FunctionCallItem.model_validate(item, strict=False))
    return items


def from_listed(
    stored: Sequence[dict[str, Any]],
) -> list[Turn]:
    """Items as ``listed`` wrote them, read back (for a chain's earlier turns)."""
    out: list[Turn] = []
    for item in stored:
        kind = item.get("type")
        if kind == "message":
            out.append(InputMessage.model_validate(item, strict=False))
        elif kind == "function_call":
            out.append(FunctionCallItem.model_validate(item, strict=False))
        elif kind == "function_call_output":
            out.append(FunctionCallOutput.model_validate(item, strict=False))
    return out
