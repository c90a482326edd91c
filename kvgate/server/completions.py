"""POST /v1/completions: a string, strings, token ids or lists of token ids; n choices each."""

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
    completion_logprobs,
    run_merged,
    usage,
)
from kvgate.server.protocol import CompletionRequest
from kvgate.server.streaming import SSE_DONE, EventStream, sse, unless_disconnected

#: OpenAI's default for the legacy completions API.
DEFAULT_MAX_TOKENS = 16


def _prompts(ctx: ServingContext, body: CompletionRequest) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [ctx.tokenizer.encode(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [ctx.tokenizer.encode(p) for p in prompt]  # type: ignore[arg-type]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def _check_unsupported(body: CompletionRequest) -> None:
    if body.suffix:
        raise InvalidRequest("suffix is not supported by this model", param="suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise InvalidRequest("best_of must equal n (or be omitted)", param="best_of")
    if body.echo and body.logprobs is not None:
        raise InvalidRequest("echo with logprobs (prompt logprobs) is not supported", param="echo")


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, http: HttpRequest
) -> dict[str, Any] | EventStream:
    ctx.check_model(body.model)
    _check_unsupported(body)
    record = access_record(http)
    record.model = ctx.served_model_name
    prompts = _prompts(ctx, body)
    record.prompt_tokens = sum(len(p) for p in prompts)
    n = body.n or 1
    ctx.engine.check_capacity(n * len(prompts))
    requests = build_choices(
        ctx,
        record.request_id,
        prompts,
        body,
        max_tokens=body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS,
        logprobs=body.logprobs,
    )
    echoes = [ctx.tokenizer.decode(r.prompt_token_ids) if body.echo else "" for r in requests]
    head = {"id": f"cmpl-{record.request_id}", "created": int(time.time()),
            "model": ctx.served_model_name}  # fmt: skip
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(_stream(ctx, requests, echoes, head, record, include_usage, n))
    return await unless_disconnected(http, _whole(ctx, requests, echoes, head, record, n))


def _prompt_tokens(requests: Sequence[Request], n: int) -> int:
    """Each prompt counts once, however many choices it has."""
    return sum(r.num_prompt_tokens for r in requests[::n])


async def _whole(
    ctx: ServingContext,
    requests: Sequence[Request],
    echoes: Sequence[str],
    head: dict[str, Any],
    record: AccessRecord,
    n: int,
) -> dict[str, Any]:
    start = time.perf_counter()
    texts = list(echoes)
    logprobs: list[list[TokenLogprobs]] = [[] for _ in requests]
    reasons: list[str | None] = [None] * len(requests)
    completion_tokens = 0
    cached = [0] * len(requests)
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
            cached[i] = out.num_cached_tokens
    record.completion_tokens = completion_tokens
    record.cached_tokens = sum(cached[::n])
    record.finish_reason = ",".join(r or "" for r in reasons)
    want_logprobs = requests[0].params.logprobs is not None
    return {
        **head,
        "object": "text_completion",
        "choices": [
            {
                "index": i,
                "text": texts[i],
                "logprobs": (
                    completion_logprobs(ctx.tokenizer, logprobs[i], len(echoes[i]))
                    if want_logprobs
                    else None
                ),
                "finish_reason": reasons[i],
            }
            for i in range(len(requests))
        ],
        "usage": usage(_prompt_tokens(requests, n), completion_tokens, sum(cached[::n])),
    }


async def _stream(
    ctx: ServingContext,
    requests: Sequence[Request],
    echoes: Sequence[str],
    head: dict[str, Any],
    record: AccessRecord,
    include_usage: bool,
    n: int,
) -> AsyncGenerator[str, None]:
    start = time.perf_counter()
    want_logprobs = requests[0].params.logprobs is not None
    extra = {"usage": None} if include_usage else {}
    offsets = [len(e) for e in echoes]  # characters of each choice's text sent so far

    def chunk(index: int, text: str, **fields: Any) -> str:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
        choice.update(fields)
        return sse({**head, "object": "text_completion", "choices": [choice], **extra})

    for i, echo in enumerate(echoes):
        if echo:
            yield chunk(i, echo)
    completion_tokens = 0
    cached = [0] * len(requests)
    reasons: list[str] = []
    try:
        async for i, out in run_merged(ctx.engine, requests):
            if record.ttft_s is None and out.new_token_ids:
                record.ttft_s = round(time.perf_counter() - start, 4)
            if out.finished and out.finish_reason == "error":
                raise RequestFailed(out.error or "generation failed")
            if out.text or (want_logprobs and out.logprobs):
                lp = (
                    completion_logprobs(ctx.tokenizer, out.logprobs, offsets[i])
                    if want_logprobs
                    else None
                )
                offsets[i] += len(out.text)
                yield chunk(i, out.text, logprobs=lp)
            if out.finished:
                yield chunk(i, "", finish_reason=out.finish_reason)
                reasons.append(out.finish_reason or "")
                completion_tokens += out.num_output_tokens
                cached[i] = out.num_cached_tokens
    except KVGateError as exc:  # headers are sent: the error travels as an event
        record.error_code = exc.code
        yield sse(error_body(exc.message, status_of(exc)[1], exc.code, exc.param))
        yield SSE_DONE
        return
    record.completion_tokens = completion_tokens
    record.cached_tokens = sum(cached[::n])
    record.finish_reason = ",".join(reasons)
    if include_usage:
        u = usage(_prompt_tokens(requests, n), completion_tokens, sum(cached[::n]))
        yield sse({**head, "object": "text_completion", "choices": [], "usage": u})
    yield SSE_DONE
