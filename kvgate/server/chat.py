"""POST /v1/chat/completions: the model's chat template, n choices, streamed or whole;
``response_format`` and ``tools`` constrain the output (``server/constraints.py``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from kvgate.engine.messages import TokenLogprobs
from kvgate.engine.outputs import RequestOutput
from kvgate.errors import InvalidRequest
from kvgate.governance.tenants import DEFAULT_TENANT
from kvgate.server.access_log import access_record
from kvgate.server.choices import admit_choices
from kvgate.server.constraints import Constraints, chat_constraints
from kvgate.server.door import off_loop
from kvgate.server.logprobs import chat_logprobs
from kvgate.server.protocol import ChatCompletionRequest
from kvgate.server.respond import respond
from kvgate.server.serving import ServingContext
from kvgate.server.streaming import EventStream
from kvgate.server.tracing import CHAT
from kvgate.server.tracker import ChoiceResult
from kvgate.structured.tools import Delta, ToolCallReader, render_history, template_history


def chat_prompt_ids(
    ctx: ServingContext, body: ChatCompletionRequest, constraints: Constraints
) -> list[int]:
    """The templated prompt's ids (on a worker thread: see ``door.off_loop``); special
    tokens' text in a message is plain text (``Tokenizer.encode_chat``). The grammar is
    compiled here too (cached by its text), so a bad one is refused before admission."""
    if constraints.grammar is not None:
        ctx.engine.engine.grammars.check(constraints.grammar)
    messages = []
    for m in body.messages:
        message = m.model_dump(exclude_none=True)
        message.setdefault("content", "")  # an assistant turn may carry no content
        messages.append(message)
    add_generation_prompt = body.add_generation_prompt is not False
    tools = None
    if ctx.tokenizer.renders_tools:  # the template writes tools, calls and results itself
        tools = [f.as_json() for f in constraints.functions] or None
        messages = template_history(messages)
    elif constraints.functions or any("tool_calls" in m or m["role"] == "tool" for m in messages):
        messages = render_history(messages, constraints.functions)
    return ctx.tokenizer.encode_chat(messages, add_generation_prompt, tools)


def _logprobs_setting(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _logprobs_field(
    ctx: ServingContext, items: Sequence[TokenLogprobs], wanted: bool
) -> dict[str, Any] | None:
    return {"content": chat_logprobs(ctx.tokenizer, items)} if wanted else None


def _delta_fields(deltas: Sequence[Delta]) -> dict[str, Any]:
    """One chunk's ``delta`` from the reader's pieces: content joined; tool calls by index
    (OpenAI's layout: the first piece of a call has its id, type and name)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.index is None:
            continue
        entry = calls.setdefault(d.index, {"index": d.index, "function": {}})
        if d.call_id is not None:
            entry.update(id=d.call_id, type="function")
            entry["function"] = {"name": d.name, "arguments": ""}
        entry["function"]["arguments"] = entry["function"].get("arguments", "") + d.arguments
    fields: dict[str, Any] = {}
    if content:
        fields["content"] = content
    if calls:
        fields["tool_calls"] = list(calls.values())
    return fields


def _finish_reason(reader: ToolCallReader, reason: str | None) -> str | None:
    return "tool_calls" if reader.called and reason == "stop" else reason


class _ChatChunks:
    object_name = "chat.completion.chunk"

    def __init__(self, ctx: ServingContext, want_logprobs: bool, readers: list[ToolCallReader]):
        self.ctx = ctx
        self.want_logprobs = want_logprobs
        self.readers = readers

    def opening(self, i: int) -> dict[str, Any] | None:
        return _choice(i, {"role": "assistant", "content": ""})

    def delta(self, i: int, out: RequestOutput) -> dict[str, Any] | None:
        lp = _logprobs_field(self.ctx, out.logprobs, self.want_logprobs)
        fields = _delta_fields(self.readers[i].feed(out.text))
        if not fields and lp is None:
            return None
        return _choice(i, fields, logprobs=lp)

    def finish(self, i: int, out: RequestOutput) -> dict[str, Any]:
        reader = self.readers[i]
        fields = _delta_fields(reader.finish())
        return _choice(i, fields, finish_reason=_finish_reason(reader, out.finish_reason))


def _choice(index: int, delta: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **fields}


def _whole_message(reader: ToolCallReader, result: ChoiceResult) -> dict[str, Any]:
    """The assistant message of a whole response: its text, or its tool calls."""
    deltas = reader.feed(result.text) + reader.finish()
    content = "".join(d.content for d in deltas)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reader.called:
        message["content"] = content or None
        message["tool_calls"] = [call.as_message() for call in reader.calls]
    return message


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, http: HttpRequest
) -> JSONResponse | EventStream:
    record = access_record(http)
    record.model = ctx.served_model_name
    ctx.door.enter(record.tenant or DEFAULT_TENANT, body)
    constraints = chat_constraints(body)
    prompt = await off_loop(chat_prompt_ids, ctx, body, constraints)
    record.prompt_tokens = len(prompt)
    response_id = f"chatcmpl-{record.request_id}"
    requests, tracker = admit_choices(
        ctx,
        http,
        [prompt],
        body,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=_logprobs_setting(body),
        operation=CHAT,
        response_id=response_id,
        grammar=constraints.grammar,
    )
    head = {"id": response_id, "created": int(time.time()),
            "model": ctx.lora_name or ctx.served_model_name}  # fmt: skip
    want_logprobs = requests[0].params.logprobs is not None
    readers = [ToolCallReader(constraints.may_call) for _ in requests]
    return await respond(
        ctx, http, requests, tracker, _ChatChunks(ctx, want_logprobs, readers), head,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        whole_object="chat.completion",
        whole_choice=lambda i, r: {
            "index": i,
            "message": _whole_message(readers[i], r),
            "logprobs": _logprobs_field(ctx, r.logprobs, want_logprobs),
            "finish_reason": _finish_reason(readers[i], r.finish_reason),
        },
    )  # fmt: skip
