"""POST /v1/chat/completions: the model's chat template, n choices, streamed or whole."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from starlette.requests import Request as HttpRequest

from kvgate.engine.messages import TokenLogprobs
from kvgate.engine.request import Request
from kvgate.errors import InvalidRequest, KVGateError, RequestFailed
from kvgate.server.access_log import AccessRecord, access_record
from kvgate.server.errors import error_body, status_of
from kvgate.server.generation import (
    ServingContext,
    build_choices,
    chat_logprobs,
    run_merged,
    usage,
)
from kvgate.server.protocol import ChatCompletionRequest
from kvgate.server.streaming import SSE_DONE, EventStream, sse, unless_disconnected


def _prompt_ids(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    messages = []
    for m in body.messages:
        message = m.model_dump(exclude_none=True)
        message.setdefault("content", "")  # an assistant turn may carry no content
        messages.append(message)
    add_generation_prompt = body.add_generation_prompt is not False
    text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    # The template writes any BOS itself.
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def _logprobs_setting(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, http: HttpRequest
) -> dict[str, Any] | EventStream:
    ctx.check_model(body.model)
    record = access_record(http)
    record.model = ctx.served_model_name
    prompt = _prompt_ids(ctx, body)
    record.prompt_tokens = len(prompt)
    n = body.n or 1
    ctx.engine.check_capacity(n)
    requests = build_choices(
        ctx,
        record.request_id,
        [prompt],
        body,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=_logprobs_setting(body),
    )
    head = {
        "id": f"chatcmpl-{record.request_id}",
        "created": int(time.time()),
        "model": ctx.served_model_name,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(_stream(ctx, requests, head, record, include_usage))
    return await unless_disconnected(http, _whole(ctx, requests, head, record))


async def _whole(
    ctx: ServingContext, requests: Sequence[Request], head: dict[str, Any], record: AccessRecord
) -> dict[str, Any]:
    start = time.perf_counter()
    texts = [""] * len(requests)
    logprobs: list[list[TokenLogprobs]] = [[] for _ in requests]
    reasons: list[str | None] = [None] * len(requests)
    completion_tokens = cached = 0
    async for i, out in run_merged(ctx.engine, requests):
        if record.ttft_s is None and out.new_token_ids:
            record.ttft_s = round(time.perf_counter() - start, 4)
        texts[i] += out.text
        logprobs[i].extend(out.logprobs)
        if out.finished:
            if out.finish_reason == "error":
                raise RequestFailed(out.error or "generation failed")
            reasons[i] = out.finish_reason
            completion_tokens += out.num_output_tokens
            cached = max(cached, out.num_cached_tokens)
    record.completion_tokens = completion_tokens
    record.cached_tokens = cached
    record.finish_reason = ",".join(r or "" for r in reasons)
    want_logprobs = requests[0].params.logprobs is not None
    return {
        **head,
        "object": "chat.completion",
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": texts[i]},
                "logprobs": (
                    {"content": chat_logprobs(ctx.tokenizer, logprobs[i])}
                    if want_logprobs
                    else None
                ),
                "finish_reason": reasons[i],
            }
            for i in range(len(requests))
        ],
        "usage": usage(requests[0].num_prompt_tokens, completion_tokens, cached),
    }


async def _stream(
    ctx: ServingContext,
    requests: Sequence[Request],
    head: dict[str, Any],
    record: AccessRecord,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    start = time.perf_counter()
    want_logprobs = requests[0].params.logprobs is not None
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], **fields: Any) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        choice.update(fields)
        return sse({**head, "object": "chat.completion.chunk", "choices": [choice], **extra})

    for i in range(len(requests)):
        yield chunk(i, {"role": "assistant", "content": ""})
    completion_tokens = cached = 0
    reasons: list[str] = []
    try:
        async for i, out in run_merged(ctx.engine, requests):
            if record.ttft_s is None and out.new_token_ids:
                record.ttft_s = round(time.perf_counter() - start, 4)
            if out.finished and out.finish_reason == "error":
                raise RequestFailed(out.error or "generation failed")
            if out.text or (want_logprobs and out.logprobs):
                lp = (
                    {"content": chat_logprobs(ctx.tokenizer, out.logprobs)}
                    if want_logprobs
                    else None
                )
                yield chunk(i, {"content": out.text}, logprobs=lp)
            if out.finished:
                yield chunk(i, {}, finish_reason=out.finish_reason)
                reasons.append(out.finish_reason or "")
                completion_tokens += out.num_output_tokens
                cached = max(cached, out.num_cached_tokens)
    except KVGateError as exc:  # headers are sent: the error travels as an event
        record.error_code = exc.code
        yield sse(error_body(exc.message, status_of(exc)[1], exc.code, exc.param))
        yield SSE_DONE
        return
    record.completion_tokens = completion_tokens
    record.cached_tokens = cached
    record.finish_reason = ",".join(reasons)
    if include_usage:
        u = usage(requests[0].num_prompt_tokens, completion_tokens, cached)
        yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": u})
    yield SSE_DONE
