"""A request's choices, from its body to admitted engine requests.

A request's choices are built (tokenized, validated, sized) before anything is sent, so a bad
request is refused with a clear error before a stream begins; they then run as separate
engine requests (``server/respond.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.requests import Request as HttpRequest

from kvgate.engine.request import Request
from kvgate.errors import InvalidRequest, KVGateError, PromptTooLong
from kvgate.governance.tenants import DEFAULT_TENANT
from kvgate.governance.usage import Counts
from kvgate.sampling_params import SamplingParams
from kvgate.server.access_log import access_record
from kvgate.server.governance import RequestContext
from kvgate.server.protocol import ChatCompletionRequest, CompletionRequest
from kvgate.server.serving import ServingContext
from kvgate.server.tracker import Tracker
from kvgate.structured.spec import Grammar


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    default_max_tokens: int,
    logprobs: int | None,
    seed: int | None,
    grammar: Grammar | None = None,
    lora_name: str | None = None,
) -> SamplingParams:
    """SamplingParams from the body's fields; OpenAI's defaults where a field is absent."""
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        seed=seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        logprobs=logprobs,
        skip_special_tokens=True if body.skip_special_tokens is None else body.skip_special_tokens,
        final_only=not body.stream,
        grammar=grammar,
        speculative=body.speculative,
        lora_name=lora_name,
    )


def build_choices(
    ctx: ServingContext,
    request_id: str,
    prompts: Sequence[list[int]],
    body: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    context: RequestContext,
    grammar: Grammar | None = None,
) -> list[Request]:
    """One engine request per (prompt, choice), choice index = prompt_index * n + j.

    With a seed, choice j samples with ``seed + j``: reproducible, yet the n choices differ.
    Without ``max_tokens`` a choice may run to the end of the context, as OpenAI's API does,
    or as far as its tenant's limits let it (``Governance.room_for``): it is charged that,
    and what it did not use is given back when it ends.
    """
    n = body.n or 1
    requests: list[Request] = []
    for p, prompt in enumerate(prompts):
        if not prompt:
            raise InvalidRequest("prompt must contain at least one token", param="prompt")
        room = ctx.max_model_len - len(prompt)
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise PromptTooLong(len(prompt), max_tokens or 1, ctx.max_model_len)
        allowed = ctx.governance.room_for(context.tenant, len(prompt), ctx.served_model_name)
        if allowed is not None:
            # At least one token: a prompt already over a limit is refused by admission,
            # naming that limit.
            room = max(1, min(room, allowed))
        for j in range(n):
            params = sampling_params(
                body,
                max_tokens=max_tokens,
                default_max_tokens=room,
                logprobs=logprobs,
                seed=None if body.seed is None else body.seed + j,
                grammar=grammar,
                lora_name=ctx.lora_name,
            )
            engine_id = f"{request_id}-{p * n + j}-{next(ctx.ids)}"
            requests.append(
                ctx.engine.engine.make_request(
                    engine_id,
                    prompt,
                    params,
                    cache_salt=_salt(context.cache_salt, body.cache_salt),
                    tenant=context.tenant,
                    deadline=context.deadline,
                    queue_deadline=context.queue_deadline,
                )
            )
    return requests


def _salt(tenant_salt: bytes | None, request_salt: str | None) -> bytes | None:
    """The prefix-cache salt of a request: its tenant's (isolated tenants), and its own."""
    if request_salt is None:
        return tenant_salt
    return (tenant_salt or b"") + b"\x00request:" + request_salt.encode()


def check_room(ctx: ServingContext, tenant: str, choices: int) -> None:
    """Refuse ``choices`` more requests that the server's queue, or the tenant's share of it,
    has no room for (``Overloaded``, counted for the tenant). Before the prompts are read
    too: a list of 400,000 prompts is refused whole, not tokenized first."""
    model = ctx.served_model_name
    try:
        gate = ctx.governance.gate(model)
        ctx.engine.check_capacity(choices, gate.total_in_flight if gate is not None else None)
        ctx.governance.check_queue_share(tenant, choices, ctx.engine.capacity, model)
    except KVGateError as exc:
        ctx.governance.count_refusal(tenant, exc.code)
        raise


def admit_choices(
    ctx: ServingContext,
    http: HttpRequest,
    prompts: Sequence[list[int]],
    body: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    operation: str,
    response_id: str,
    grammar: Grammar | None = None,
) -> tuple[list[Request], Tracker]:
    """Build the request's choices and admit them against the server's and the tenant's
    limits (every refusal is counted for the tenant under its code); start its trace."""
    record = access_record(http)
    tenant = record.tenant or DEFAULT_TENANT
    check_room(ctx, tenant, (body.n or 1) * len(prompts))
    try:
        timeout = body.timeout if body.timeout is not None else _header_timeout(http)
        context = ctx.governance.context(tenant, timeout, http.headers.get("authorization"))
        requests = build_choices(
            ctx, record.request_id, prompts, body,
            max_tokens=max_tokens, logprobs=logprobs, context=context, grammar=grammar,
        )  # fmt: skip
    except KVGateError as exc:
        ctx.governance.count_refusal(tenant, exc.code)
        raise
    # Charged at the door.
    admission = ctx.governance.admit(tenant, requests, model=ctx.served_model_name, paid=True)
    n = body.n or 1
    row = ctx.usage.admit(
        record.request_id, tenant, ctx.served_model_name, ctx.model_version,
        prompt_tokens=sum(r.num_prompt_tokens for r in requests[::n]),
    )  # fmt: skip
    try:
        span = ctx.tracing.start(
            http.headers,
            operation=operation,
            model=ctx.served_model_name,
            tenant=tenant,
            request_id=record.request_id,
            requests=requests,
            model_version=ctx.model_version,
        )
    except BaseException:
        admission.release()
        ctx.usage.settle(row, Counts(), "refused")  # never delivered: removed
        raise
    tracker = Tracker(record, admission, requests, span, response_id, n, ctx.usage, row)
    return requests, tracker


def _header_timeout(http: HttpRequest) -> float | None:
    raw = http.headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InvalidRequest(
            f"x-request-timeout must be a positive number of seconds, got {raw!r}",
            param="x-request-timeout",
        )
    return value
