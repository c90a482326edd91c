"""POST /v1/chat/completions: the model's chat template, n choices, streamed or whole."""

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
from kvgate.server.door import off_loop
from kvgate.server.generation import (
    ServingContext,
    admit_choices,
    chat_logprobs,
    respond,
)
from kvgate.server.protocol import ChatCompletionRequest
from kvgate.server.streaming import EventStream
from kvgate.server.tracing import CHAT


def _prompt_ids(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    """The templated prompt's ids (on a worker thread: see ``door.off_loop``); special
    tokens' text in a message is plain text (``Tokenizer.encode_chat``)."""
    messages = []
    for m in body.messages:
        message = m.model_dump(exclude_none=True)
        message.setdefault("content", "")  # an assistant turn may carry no content
        messages.append(message)
    add_generation_prompt = body.add_generation_prompt is not False
    return ctx.tokenizer.encode_chat(messages, add_generation_prompt)


def _logprobs_setting(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _logprobs_field(
    ctx: ServingContext, items: Sequence[TokenLogprobs], wanted: bool
) -> dict[str, Any] | None:
    return {"content": chat_logprobs(ctx.tokenizer, items)} if wanted else None


class _ChatChunks:
    object_name = "chat.completion.chunk"

    def __init__(self, ctx: ServingContext, want_logprobs: bool) -> None:
        self.ctx = ctx
        self.want_logprobs = want_logprobs

    def opening(self, i: int) -> dict[str, Any] | None:
        return _choice(i, {"role": "assistant", "content": ""})

    def delta(self, i: int, out: RequestOutput) -> dict[str, Any]:
        lp = _logprobs_field(self.ctx, out.logprobs, self.want_logprobs)
        return _choice(i, {"content": out.text}, logprobs=lp)

    def finish(self, i: int, out: RequestOutput) -> dict[str, Any]:
        return _choice(i, {}, finish_reason=out.finish_reason)


def _choice(index: int, delta: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **fields}


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, http: HttpRequest
) -> JSONResponse | EventStream:
    ctx.check_model(body.model)
    record = access_record(http)
    record.model = ctx.served_model_name
    ctx.door.enter(record.tenant or DEFAULT_TENANT, body)
    prompt = await off_loop(_prompt_ids, ctx, body)
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
    )
    head = {"id": response_id, "created": int(time.time()),
            "model": ctx.served_model_name}  # fmt: skip
    want_logprobs = requests[0].params.logprobs is not None
    return await respond(
        ctx, http, requests, tracker, _ChatChunks(ctx, want_logprobs), head,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        whole_object="chat.completion",
        whole_choice=lambda i, r: {
            "index": i,
            "message": {"role": "assistant", "content": r.text},
            "logprobs": _logprobs_field(ctx, r.logprobs, want_logprobs),
            "finish_reason": r.finish_reason,
        },
    )  # fmt: skip
