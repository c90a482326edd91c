"""What chat and completions share: sampling parameters from a body, n choices run together,
and logprobs in the two OpenAI layouts.

A request's choices are built (tokenized, validated, sized) before anything is sent, so a bad
request is refused with a clear error before a stream begins; they then run as separate
engine requests whose deltas are merged in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

import kvgate
from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.messages import TokenLogprobs
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.request import Request
from kvgate.engine.stats import RequestMetrics
from kvgate.errors import InvalidRequest, KVGateError, PromptTooLong, QueueTimeout, RequestFailed
from kvgate.governance.tenants import DEFAULT_TENANT
from kvgate.governance.usage import Counts, UsageLedger
from kvgate.sampling_params import SamplingParams
from kvgate.server.access_log import AccessRecord, access_record
from kvgate.server.door import Door
from kvgate.server.errors import error_body, status_of
from kvgate.server.governance import Admission, Governance, RequestContext
from kvgate.server.protocol import ChatCompletionRequest, CompletionRequest
from kvgate.server.streaming import SSE_DONE, EventStream, sse, unless_disconnected
from kvgate.server.tracing import NoTracing, RequestSpan, Tracing
from kvgate.structured.spec import Grammar
from kvgate.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServingContext:
    engine: AsyncLLM
    served_model_name: str
    governance: Governance
    door: Door
    usage: UsageLedger
    tracing: Tracing | NoTracing = field(default_factory=NoTracing)
    #: Makes engine request ids unique even when clients reuse an x-request-id.
    ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def model_version(self) -> str:
        """What served the request, for usage records."""
        return f"{self.served_model_name}@kvgate-{kvgate.__version__}"


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    default_max_tokens: int,
    logprobs: int | None,
    seed: int | None,
    grammar: Grammar | None = None,
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
    try:
        model = ctx.served_model_name
        gate = ctx.governance.gate(model)
        choices = (body.n or 1) * len(prompts)
        ctx.engine.check_capacity(choices, gate.total_in_flight if gate is not None else None)
        ctx.governance.check_queue_share(tenant, choices, ctx.engine.capacity, model)
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


async def run_merged(
    engine: AsyncLLM, requests: Sequence[Request]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Deltas of all ``requests`` as (choice index, delta), each choice's in order.

    Leaving early (a disconnect cancels the consumer) aborts every choice still running.
    """
    if len(requests) == 1:
        async for out in engine.stream(requests[0]):
            yield 0, out
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, request: Request) -> None:
        try:
            async for out in engine.stream(request):
                await merged.put((index, out))
        except Exception as exc:
            await merged.put((index, exc))
        else:
            await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # runs each stream's cleanup: its request is aborted in the engine
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


# ------------------------------------------------------------------ running the choices


@dataclass
class ChoiceResult:
    """One choice, whole: what a non-streamed response is built from."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


def check_finish(out: RequestOutput) -> None:
    """Finish reasons that are failures of the request, raised as their errors."""
    if out.finish_reason == "error":
        raise RequestFailed(out.error or "generation failed")
    if out.finish_reason == "queue_timeout":
        raise QueueTimeout(
            "the request waited longer than its tenant's max_queue_time and was not started; "
            "retry later"
        )


class Tracker:
    """Book-keeping shared by whole and streamed responses: time to first token for the
    access log, tokens used per choice (admission refunds what was not), totals for usage,
    the request's trace span. ``close`` once the response is over, however it ended."""

    def __init__(
        self,
        record: AccessRecord,
        admission: Admission,
        requests: Sequence[Request],
        span: RequestSpan,
        response_id: str,
        n: int,
        ledger: UsageLedger,
        usage_row: str,
    ) -> None:
        self.ledger = ledger
        self.usage_row = usage_row
        self.delivered = False  # the usage row knows tokens reached the client
        self.settled = False
        self.record = record
        self.admission = admission
        self.span = span
        self.response_id = response_id
        self.n = n
        self.start = time.monotonic()
        self.results = [ChoiceResult() for _ in requests]
        self.error: str | None = None

    def counts(self) -> Counts:
        """Tokens so far, for the usage record (each prompt once, however many choices)."""
        firsts = self.results[:: self.n]
        metrics = [r.metrics for r in self.results if r.metrics is not None]
        return Counts(
            prompt_tokens=sum(r.num_prompt_tokens for r in firsts)
            or self.record.prompt_tokens
            or 0,
            completion_tokens=sum(r.num_output_tokens for r in self.results),
            cached_tokens=sum(r.num_cached_tokens for r in firsts),
            kv_block_seconds=round(sum(m.kv_block_seconds for m in metrics), 6),
        )

    async def deliver(self) -> None:
        """Tokens are about to reach the client: the usage row must say so first."""
        if not self.delivered:
            self.delivered = True
            await asyncio.wrap_future(self.ledger.delivered(self.usage_row, self.counts()))

    async def settle_whole(self) -> None:
        """A whole response is about to be sent: its final usage record, committed first."""
        self.settled = True
        self.delivered = True
        reason = ",".join(r.finish_reason or "" for r in self.results)
        future = self.ledger.settle(self.usage_row, self.counts(), reason, delivered=True)
        await asyncio.wrap_future(future)

    def close(self) -> None:
        if not self.settled:  # a stream's end (or a failure): queued, not waited for
            self.settled = True
            reason = self.error or ",".join(r.finish_reason or "" for r in self.results)
            self.ledger.settle(self.usage_row, self.counts(), reason)
        self.admission.release()
        firsts = self.results[:: self.n]
        self.span.finish(
            [r.metrics for r in self.results],
            response_id=self.response_id,
            finish_reasons=[r.finish_reason for r in self.results],
            input_tokens=sum(r.num_prompt_tokens for r in firsts),
            output_tokens=sum(r.num_output_tokens for r in self.results),
            cached_tokens=sum(r.num_cached_tokens for r in firsts),
            error=self.error if self.error is not None else self.record.error_code,
        )

    def on_output(self, i: int, out: RequestOutput) -> None:
        if self.record.ttft_s is None and out.new_token_ids:
            # A whole response gets one output at the end: the engine's clock says when the
            # first token came (the same clock as ``start``).
            first = out.metrics.first_token_time if out.metrics is not None else None
            now = first if out.finished and first is not None else time.monotonic()
            self.record.ttft_s = round(now - self.start, 4)
        result = self.results[i]
        result.text += out.text
        result.logprobs.extend(out.logprobs)
        result.num_output_tokens += len(out.new_token_ids)
        if out.finished:
            self.admission.used[i] = out.num_prompt_tokens + out.num_output_tokens
            if out.metrics is not None and self.record.queue_s is None:
                self.record.queue_s = round(out.metrics.queue_seconds, 4)
                self.record.prefill_s = round(out.metrics.prefill_seconds, 4)
                self.record.decode_s = round(out.metrics.decode_seconds, 4)
            check_finish(out)
            result.finish_reason = out.finish_reason
            result.num_prompt_tokens = out.num_prompt_tokens
            result.num_output_tokens = out.num_output_tokens  # the engine's count, final
            result.num_cached_tokens = out.num_cached_tokens
            result.metrics = out.metrics

    def profile(self) -> dict[str, Any]:
        return profile_of(self.results)

    def usage(self) -> dict[str, Any]:
        """Usage over all choices; each prompt counts once however many choices it has."""
        firsts = self.results[:: self.n]
        u = usage(
            sum(r.num_prompt_tokens for r in firsts),
            sum(r.num_output_tokens for r in self.results),
            sum(r.num_cached_tokens for r in firsts),
        )
        u["profile"] = self.profile()
        self.record.completion_tokens = u["completion_tokens"]
        self.record.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
        self.record.finish_reason = ",".join(r.finish_reason or "" for r in self.results)
        return u


PROFILE_HEADERS = {
    "queue_seconds": "x-kvgate-queue-seconds",
    "prefill_seconds": "x-kvgate-prefill-seconds",
    "decode_seconds": "x-kvgate-decode-seconds",
    "peak_kv_blocks": "x-kvgate-peak-kv-blocks",
}


def profile_of(results: Sequence[ChoiceResult]) -> dict[str, Any]:
    """Where the request's time and memory went (kvgate's documented ``usage.profile``):
    the slowest choice's queue, prefill and decode seconds; KV blocks at peak, all choices."""
    metrics = [r.metrics for r in results if r.metrics is not None]
    return {
        "queue_seconds": round(max((m.queue_seconds for m in metrics), default=0.0), 4),
        "prefill_seconds": round(max((m.prefill_seconds for m in metrics), default=0.0), 4),
        "decode_seconds": round(max((m.decode_seconds for m in metrics), default=0.0), 4),
        "peak_kv_blocks": sum(m.peak_kv_blocks for m in metrics),
    }


def profile_headers(profile: dict[str, Any]) -> dict[str, str]:
    return {header: str(profile[key]) for key, header in PROFILE_HEADERS.items()}


class ChunkRenderer(Protocol):
    """How one API spells its stream: the opening chunks, a delta, a choice's end."""

    object_name: str

    def opening(self, i: int) -> dict[str, Any] | None: ...

    def delta(self, i: int, out: RequestOutput) -> dict[str, Any] | None:
        """None: nothing to send yet (text held back, e.g. while it may begin a tool call)."""

    def finish(self, i: int, out: RequestOutput) -> dict[str, Any]: ...


async def stream_choices(
    ctx: ServingContext,
    requests: Sequence[Request],
    tracker: Tracker,
    render: ChunkRenderer,
    head: dict[str, Any],
    *,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    """SSE events of all choices: openings, deltas in order, a finish per choice, the usage
    chunk when asked, ``[DONE]``. A failure after the headers went out is an error event."""
    extra = {"usage": None} if include_usage else {}
    want_logprobs = requests[0].params.logprobs is not None

    def event(choice: dict[str, Any]) -> str:
        return sse({**head, "object": render.object_name, "choices": [choice], **extra})

    for i in range(len(requests)):
        opening = render.opening(i)
        if opening is not None:
            yield event(opening)
    try:
        async for i, out in run_merged(ctx.engine, requests):
            tracker.on_output(i, out)
            chunk = render.delta(i, out) if out.text or (want_logprobs and out.logprobs) else None
            if chunk is not None:
                await tracker.deliver()
                yield event(chunk)
            elif out.new_token_ids:
                tracker.ledger.progress(tracker.usage_row, tracker.counts())
            if out.finished:
                last = render.finish(i, out)
                if last.get("delta"):  # text held back until now reaches the client
                    await tracker.deliver()
                yield event(last)
    except KVGateError as exc:  # headers are sent: the error travels as an event
        tracker.record.error_code = exc.code
        tracker.error = exc.code
        if isinstance(exc, QueueTimeout):
            ctx.governance.count_refusal(requests[0].tenant, exc.code)
        yield sse(error_body(exc.message, status_of(exc)[1], exc.code, exc.param))
        yield SSE_DONE
        return
    u = tracker.usage()
    if include_usage:
        yield sse({**head, "object": render.object_name, "choices": [], "usage": u})
    yield SSE_DONE


async def respond(
    ctx: ServingContext,
    http: HttpRequest,
    requests: Sequence[Request],
    tracker: Tracker,
    render: ChunkRenderer,
    head: dict[str, Any],
    *,
    stream: bool,
    include_usage: bool,
    whole_object: str,
    whole_choice: Callable[[int, ChoiceResult], dict[str, Any]],
) -> JSONResponse | EventStream:
    """The response to admitted choices: an SSE stream, or the whole JSON body (with the
    profile headers) once every choice is done. The tracker is closed however it ends."""
    if stream:
        events = stream_choices(ctx, requests, tracker, render, head, include_usage=include_usage)
        stalled = ctx.door.limits.stalled_client_timeout
        return EventStream(events, on_close=tracker.close, stalled_timeout=stalled)
    try:
        results = await unless_disconnected(http, collect_choices(ctx, requests, tracker))
        await tracker.settle_whole()
    finally:
        tracker.close()
    response = {
        **head,
        "object": whole_object,
        "choices": [whole_choice(i, r) for i, r in enumerate(results)],
        "usage": tracker.usage(),
    }
    return JSONResponse(response, headers=profile_headers(tracker.profile()))


async def collect_choices(
    ctx: ServingContext, requests: Sequence[Request], tracker: Tracker
) -> list[ChoiceResult]:
    try:
        async for i, out in run_merged(ctx.engine, requests):
            tracker.on_output(i, out)
    except KVGateError as exc:
        tracker.error = exc.code
        if isinstance(exc, QueueTimeout):
            ctx.governance.count_refusal(requests[0].tenant, exc.code)
        raise
    return tracker.results


# ------------------------------------------------------------------ logprobs layouts


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {
        "token": raw.decode("utf-8", errors="replace"),
        "logprob": logprob,
        "bytes": list(raw),
    }


def chat_logprobs(tokenizer: Tokenizer, items: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` of the chat API."""
    return [
        {
            **_token_entry(tokenizer, lp.token_id, lp.logprob),
            "top_logprobs": [_token_entry(tokenizer, t, v) for t, v in lp.top_logprobs],
        }
        for lp in items
    ]


def completion_logprobs(
    tokenizer: Tokenizer, items: Sequence[TokenLogprobs], text_offset: int
) -> dict[str, Any]:
    """``choices[].logprobs`` of the legacy completions API; offsets count characters."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp in items:
        text = tokenizer.token_bytes(lp.token_id).decode("utf-8", errors="replace")
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for t, v in lp.top_logprobs:
            top.setdefault(tokenizer.token_bytes(t).decode("utf-8", errors="replace"), v)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
