"""``POST /v1/responses``: a request in chat's terms (``items.py``), searched when it has
the ``file_search`` tool (``file_search.py``), admitted and run as a chat request under the
caller's tenant (its limits, priority, usage record and prefix-cache salt), and answered
whole, streamed, or in the background, stored unless ``store`` is false (``stored.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from kvgate.engine.request import Request as EngineRequest
from kvgate.errors import InvalidRequest, KVGateError, RequestTooLarge
from kvgate.governance.tenants import DEFAULT_TENANT, TenantSpec
from kvgate.retrieval.extra import missing_modules, unavailable
from kvgate.retrieval.service import DocsService, NotFound
from kvgate.server.access_log import access_record
from kvgate.server.chat import chat_prompt_ids
from kvgate.server.choices import admit_choices
from kvgate.server.constraints import chat_constraints
from kvgate.server.door import Prompt, charge, off_loop
from kvgate.server.errors import error_body, status_of
from kvgate.server.files import Caller
from kvgate.server.protocol import ChatCompletionRequest
from kvgate.server.respond import run_merged
from kvgate.server.responses.answer import Answer, usage_of
from kvgate.server.responses.background import POLL_S, BackgroundRuns
from kvgate.server.responses.file_search import file_search_tool, retrieve, sources_system
from kvgate.server.responses.items import (
    chat_messages,
    chat_tool_choice,
    chat_tools,
    from_listed,
    from_output,
    function_tools,
    input_items,
    listed,
    response_format,
)
from kvgate.server.responses.protocol import ResponsesRequest
from kvgate.server.responses.stored import STOPPED, ResponseStore
from kvgate.server.serving import ServingContext
from kvgate.server.streaming import ClientDisconnected, EventStream, unless_disconnected
from kvgate.server.tracing import CHAT
from kvgate.server.tracker import Tracker

log = logging.getLogger("kvgate.server")

#: Writes of rows whose stream was closed: kept referenced until they are done.
_PENDING: set[asyncio.Task[None]] = set()

#: Tokens kept free for the answer when the request sets no max_output_tokens.
DEFAULT_ANSWER_TOKENS = 512


@dataclass
class Where:
    """What a response is made with, besides its body: the model, the documents and the
    stored responses, and who asks."""

    ctx: ServingContext
    docs: DocsService | None
    store: ResponseStore | None
    background: BackgroundRuns
    caller: Caller


def _check_input(ctx: ServingContext, count: int, prompts: list[Prompt], spec: TenantSpec) -> None:
    """The door's limits on the input's messages and prompt, before any search."""
    if count > ctx.door.limits.max_messages:
        raise RequestTooLarge(
            f"{count} input messages; at most {ctx.door.limits.max_messages} per request",
            param="input",
        )
    ctx.door.check_prompts(prompts, spec, "input")


def _tokens(ctx: ServingContext, text: str) -> int:
    return len(ctx.tokenizer.encode(text, add_special_tokens=False))


def _history(where: Where, body: ResponsesRequest) -> list[Any]:
    """The earlier turns of a ``previous_response_id`` chain, as input items."""
    if body.previous_response_id is None:
        return []
    if where.store is None:
        raise InvalidRequest(
            "previous_response_id needs stored responses", param="previous_response_id"
        )
    chain = where.store.chain(body.previous_response_id, where.caller.scope)
    if not chain:
        raise NotFound(
            f"No response found with id '{body.previous_response_id}'.",
            param="previous_response_id",
        )
    items: list[Any] = []
    for row in chain:
        items += from_listed(row.input) + from_output(row.response.get("output", []))
    return items


def _chat_body(
    body: ResponsesRequest,
    answer: Answer,
    ctx: ServingContext,
    messages: list[dict[str, Any]],
    question: str,
    context: int,
) -> ChatCompletionRequest:
    """The chat request that answers: the instructions and the sources in the system turn,
    as many sources as fit in ``context`` tokens (the model's, or the tenant's max_context)
    beside the conversation, the chat template's own tokens and the answer."""
    system = body.instructions or ""
    if answer.search is not None:
        room = context - (body.max_output_tokens or DEFAULT_ANSWER_TOKENS)
        conversation = "".join(str(m.get("content") or "") for m in messages) + system
        room -= _tokens(ctx, conversation) + 16 * (len(messages) + 1) + 64
        sources = sources_system(answer, question, room, lambda t: _tokens(ctx, t))
        if sources:
            system = (system + "\n\n" if system else "") + sources
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    functions = function_tools(body)
    return ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": messages,
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            # A background run streams inside the server: it can be cancelled mid-way.
            "stream": bool(body.stream or body.background),
            "tools": chat_tools(functions),
            "tool_choice": chat_tool_choice(body.tool_choice, bool(functions)),
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": response_format(body),
        },
        strict=False,
    )


def _check_body(body: ResponsesRequest, where: Where) -> None:
    if body.background and not body.stored:
        raise InvalidRequest("background responses must be stored (store: true)", param="store")
    if body.background and body.stream:
        raise InvalidRequest(
            "background responses are polled (GET /v1/responses/{id}), not streamed",
            param="stream",
        )
    if (body.stored or body.previous_response_id) and where.store is None:
        raise unavailable(missing_modules())  # pragma: no cover - a store always opens
    if body.answer_mode == "extract" and function_tools(body):
        raise InvalidRequest(
            "answer_mode 'extract' quotes a clause as the answer; it cannot be combined with "
            "function tools",
            param="answer_mode",
        )


async def create_response(
    where: Where, body: ResponsesRequest, http: Request
) -> JSONResponse | EventStream:
    ctx = where.ctx
    _check_body(body, where)
    tool = file_search_tool(body)
    if tool is not None and where.docs is None:
        raise unavailable(missing_modules())
    record = access_record(http)
    record.model = ctx.served_model_name
    # The tenant's request rate first, then the input's size: the search, the embedding
    # and the answer are work (a 4 MB input took 88 s of search and tokenizing before its
    # size was checked).
    who = record.tenant or DEFAULT_TENANT
    charge(ctx.governance, who)
    own = input_items(body)
    history = await run_in_threadpool(_history, where, body)
    messages = chat_messages([*history, *own])
    if not messages:
        raise InvalidRequest("input needs at least one message", param="input")
    question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    if tool is not None and not str(question).strip():
        raise InvalidRequest("file_search needs a user message with text", param="input")
    spec = ctx.governance.spec(who)
    texts = [str(m.get("content") or "") for m in messages] + [body.instructions or ""]
    texts += [c["function"]["name"] + c["function"]["arguments"]
              for m in messages for c in m.get("tool_calls", ())]  # fmt: skip
    texts.append(json.dumps(body.tools) if body.tools else "")
    ctx.door.counted(who, _check_input, ctx, len(messages), [(texts, 0)], spec)
    store = where.store if body.stored else None
    if store is not None:
        await run_in_threadpool(store.check_room, where.caller.tenant)
    answer = Answer(body, ctx.served_model_name, may_call=False)
    if tool is not None and where.docs is not None:
        for store_id in tool.vector_store_ids:  # each is the caller's, before any work
            where.docs.vector_store(where.caller.tenant, store_id)
        await retrieve(ctx, http, where.docs, where.caller.tenant, tool, answer, str(question))
    context = min(ctx.max_model_len, spec.max_context or ctx.max_model_len)
    chat = await off_loop(_chat_body, body, answer, ctx, messages, str(question), context)
    ctx.door.enter(who, chat, charged=True)
    constraints = chat_constraints(chat)
    answer.reading(constraints.may_call)
    prompt = await off_loop(chat_prompt_ids, ctx, chat, constraints)
    record.prompt_tokens = len(prompt)
    requests, tracker = admit_choices(
        ctx, http, [prompt], chat, max_tokens=chat.max_tokens, logprobs=None, operation=CHAT,
        response_id=answer.id, grammar=constraints.grammar,
    )  # fmt: skip
    run = _Run(ctx, requests, tracker, answer, store)
    try:
        if store is not None:
            status = "queued" if body.background else "in_progress"
            await run_in_threadpool(store.create, where.caller.tenant, answer.response(status),
                                    listed(own), body.previous_response_id)  # fmt: skip
    except BaseException:
        tracker.close()
        raise
    if body.background:
        where.background.start(answer.id, run.background(where.background))
        return JSONResponse(answer.response("queued"))
    if body.stream:
        return EventStream(
            run.stream(), on_close=run.closed,
            stalled_timeout=ctx.door.limits.stalled_client_timeout,
        )  # fmt: skip
    try:
        await unless_disconnected(http, run.collect())
        await tracker.settle_whole()
    except BaseException as exc:
        await run.stopped(exc)
        raise
    finally:
        tracker.close()
    return JSONResponse(await run.done())


#: A failed response's ``error.code``: OpenAI's list has few codes; kvgate's own code goes
#: into the message (``[queue_timeout] ...``).
_RATE_CODES = frozenset({"queue_timeout", "rate_limit_exceeded", "tenant_limit_exceeded",
                         "overloaded"})  # fmt: skip
_PROMPT_CODES = frozenset({"context_length_exceeded", "invalid_request_error", "grammar_failed"})


def public_error(error: dict[str, Any] | None) -> dict[str, Any] | None:
    """``error`` with a code from OpenAI's ``ResponseError`` list."""
    if error is None:
        return None
    code = str(error.get("code") or "server_error")
    if code in ("server_error", "rate_limit_exceeded", "invalid_prompt"):
        return {"code": code, "message": error.get("message", "")}
    public = "rate_limit_exceeded" if code in _RATE_CODES else (
        "invalid_prompt" if code in _PROMPT_CODES else "server_error")  # fmt: skip
    return {"code": public, "message": f"[{code}] {error.get('message', '')}"}


class _Run:
    """A response's generation, whole, streamed or in the background, with its stored row
    written when it ends (however it ends)."""

    def __init__(
        self,
        ctx: ServingContext,
        requests: Sequence[EngineRequest],
        tracker: Tracker,
        answer: Answer,
        store: ResponseStore | None,
    ) -> None:
        self.ctx = ctx
        self.requests = requests
        self.tracker = tracker
        self.answer = answer
        self.store = store
        self.ended = False

    def _final(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        answer, tracker = self.answer, self.tracker
        answer.finish_reason = tracker.results[0].finish_reason or (
            "abort" if status == "cancelled" else None
        )
        answer.usage = usage_of(tracker)
        if not answer.usage["input_tokens"]:  # cut before the engine told its counts
            prompt = tracker.record.prompt_tokens or 0
            answer.usage["input_tokens"] = prompt
            answer.usage["total_tokens"] = prompt + answer.usage["output_tokens"]
        return answer.response(status, public_error(error))

    async def _write(self, response: dict[str, Any], force: bool = False) -> None:
        """The row's last word, written even while the task is being cancelled (a stream
        whose client left is closed inside a cancelled scope: unshielded, the write never
        ran and the row stayed ``in_progress``)."""
        self.ended = True
        if self.store is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                await run_in_threadpool(self.store.finish, response, force)
            except Exception:
                log.exception("stored response %s: its final state was not written", response["id"])

    def closed(self) -> None:
        """The stream's response is over (``EventStream.on_close``): the tracker closes, and
        a row the stream never ended (the client left before or while it ran) is failed."""
        self.tracker.close()
        if not self.ended and self.store is not None:
            self.ended = True
            task = asyncio.get_running_loop().create_task(
                self.stopped(ClientDisconnected("the client left"), force=True)
            )
            _PENDING.add(task)
            task.add_done_callback(_PENDING.discard)

    async def done(self) -> dict[str, Any]:
        response = self._final("completed")
        await self._write(response)
        return response

    async def stopped(self, exc: BaseException, force: bool = False) -> None:
        """The run ended early: its row says how (a client that left: ``failed``)."""
        if self.ended and not force:
            return
        if isinstance(exc, KVGateError):
            error = {"code": exc.code, "message": exc.message}
        else:
            error = {"code": "client_disconnected",
                     "message": "the client left before the response was complete"}  # fmt: skip
        await self._write(self._final("failed", error))

    async def collect(self) -> None:
        text = ""
        async for i, out in run_merged(self.ctx.engine, self.requests):
            self.tracker.on_output(i, out)
            text += out.text
        self.answer.collect(text)

    async def stream(self) -> AsyncGenerator[str, None]:
        answer, tracker = self.answer, self.tracker
        try:
            if answer.prefix:  # quoted evidence goes out with the opening events
                await tracker.deliver()
            for event in answer.opening():
                yield event
            async for i, out in run_merged(self.ctx.engine, self.requests, tracker.watch):
                tracker.on_output(i, out)
                events = answer.feed(out.text) if out.text else []
                if events:
                    await tracker.deliver()
                for event in events:
                    yield event
            answer.finish_reason = tracker.results[0].finish_reason
            for event in answer.finish():
                yield event
        except KVGateError as exc:
            tracker.record.error_code = exc.code
            tracker.error = exc.code
            error = error_body(exc.message, status_of(exc)[1], exc.code, exc.param)["error"]
            yield answer.event("error", code=exc.code, message=exc.message, param=exc.param)
            response = self._final("failed", error)
            await self._write(response)
            yield answer.event("response.failed", response=response)
            return
        except BaseException as exc:
            await self.stopped(exc)
            raise
        final = self._final("completed")
        await self._write(final)
        yield answer.event(f"response.{final['status']}", response=final)

    async def background(self, runs: BackgroundRuns) -> None:
        """A background run: its row is all the client sees. A cancel from another
        process marks the row; this run looks at it every ``POLL_S`` seconds."""
        assert self.store is not None
        answer, store = self.answer, self.store
        run = asyncio.current_task()
        assert run is not None
        watch = asyncio.get_running_loop().create_task(self._watch(store, run))
        try:
            await run_in_threadpool(store.started, answer.id)
            async for i, out in run_merged(self.ctx.engine, self.requests, self.tracker.watch):
                self.tracker.on_output(i, out)
                answer.feed(out.text)
            answer.finish_reason = self.tracker.results[0].finish_reason
            answer.finish()
            await self.tracker.settle_whole()
            await self._write(self._final("completed"))
        except KVGateError as exc:
            self.tracker.error = exc.code
            await self._write(self._final("failed", {"code": exc.code, "message": exc.message}))
        except asyncio.CancelledError:  # by the client, or the server is stopping
            answer.finish()
            if runs.stopping:
                await self._write(self._final("failed", STOPPED))
                raise
            await self._write(self._final("cancelled"), force=True)
        except Exception as exc:  # a bug or the database: the row must not stay queued
            log.exception("background response %s failed", answer.id)
            error = {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}
            await self._write(self._final("failed", error))
        finally:
            watch.cancel()
            self.tracker.close()

    async def _watch(self, store: ResponseStore, run: asyncio.Task[Any]) -> None:
        """Every ``POLL_S`` seconds, the run's row: cancelled (or deleted) by another
        process, the run is cancelled here, queued or running."""
        while True:
            await asyncio.sleep(POLL_S)
            if await run_in_threadpool(store.status, self.answer.id) in (None, "cancelled"):
                run.cancel()
                return
