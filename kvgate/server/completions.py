"""POST /v1/completions: a string, strings, token ids or lists of token ids; n choices each."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from kvgate.engine.outputs import RequestOutput
from kvgate.errors import InvalidRequest
from kvgate.governance.tenants import DEFAULT_TENANT
from kvgate.server.access_log import access_record
from kvgate.server.choices import admit_choices, check_room
from kvgate.server.constraints import completion_constraints
from kvgate.server.door import charge, num_prompts, off_loop
from kvgate.server.logprobs import completion_logprobs
from kvgate.server.protocol import CompletionRequest
from kvgate.server.respond import respond
from kvgate.server.serving import ServingContext
from kvgate.server.streaming import EventStream
from kvgate.server.tracing import TEXT_COMPLETION
from kvgate.structured.spec import Grammar

#: OpenAI's default for the legacy completions API.
DEFAULT_MAX_TOKENS = 16


def _prompts(
    ctx: ServingContext, body: CompletionRequest, grammar: Grammar | None
) -> list[list[int]]:
    """The prompts' ids (on a worker thread), and the grammar compiled (see chat.py)."""
    if grammar is not None:
        ctx.engine.engine.grammars.check(grammar)
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


class _CompletionChunks:
    object_name = "text_completion"

    def __init__(self, ctx: ServingContext, echoes: Sequence[str], want_logprobs: bool) -> None:
        self.ctx = ctx
        self.echoes = echoes
        self.want_logprobs = want_logprobs
        self.offsets = [len(e) for e in echoes]  # characters of each choice sent so far

    def opening(self, i: int) -> dict[str, Any] | None:
        return _choice(i, self.echoes[i]) if self.echoes[i] else None

    def delta(self, i: int, out: RequestOutput) -> dict[str, Any]:
        lp = None
        if self.want_logprobs:
            lp = completion_logprobs(self.ctx.tokenizer, out.logprobs, self.offsets[i])
        self.offsets[i] += len(out.text)
        return _choice(i, out.text, logprobs=lp)

    def finish(self, i: int, out: RequestOutput) -> dict[str, Any]:
        return _choice(i, "", finish_reason=out.finish_reason)


def _choice(index: int, text: str, **fields: Any) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": None, **fields}


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, http: HttpRequest
) -> JSONResponse | EventStream:
    _check_unsupported(body)
    record = access_record(http)
    record.model = ctx.served_model_name
    tenant = record.tenant or DEFAULT_TENANT
    n = body.n or 1
    charge(ctx.governance, tenant, n * num_prompts(body))
    check_room(ctx, tenant, n * num_prompts(body))  # before a prompt of a long list is read
    ctx.door.enter(tenant, body, charged=True)
    grammar = completion_constraints(body).grammar
    prompts = await off_loop(_prompts, ctx, body, grammar)
    record.prompt_tokens = sum(len(p) for p in prompts)
    # Before admission: nothing that may fail stands between admitting and the response.
    prompt_texts = [ctx.tokenizer.decode(p) if body.echo else "" for p in prompts]
    response_id = f"cmpl-{record.request_id}"
    requests, tracker = admit_choices(
        ctx,
        http,
        prompts,
        body,
        max_tokens=body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS,
        logprobs=body.logprobs,
        operation=TEXT_COMPLETION,
        response_id=response_id,
        grammar=grammar,
    )
    echoes = [prompt_texts[i // n] for i in range(len(requests))]
    head = {"id": response_id, "created": int(time.time()),
            "model": ctx.lora_name or ctx.served_model_name}  # fmt: skip
    want_logprobs = requests[0].params.logprobs is not None
    return await respond(
        ctx, http, requests, tracker, _CompletionChunks(ctx, echoes, want_logprobs), head,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        whole_object="text_completion",
        whole_choice=lambda i, r: {
            "index": i,
            "text": echoes[i] + r.text,
            "logprobs": (
                completion_logprobs(ctx.tokenizer, r.logprobs, len(echoes[i]))
                if want_logprobs
                else None
            ),
            "finish_reason": r.finish_reason,
        },
    )  # fmt: skip
