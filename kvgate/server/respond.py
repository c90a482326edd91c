"""Running admitted choices and answering with them: n choices merged in arrival order, as
an SSE stream (each API spells its chunks through a ``ChunkRenderer``) or one JSON body."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from kvgate.engine.front import EngineFront
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.request import Request
from kvgate.engine.streams import OnAbandoned
from kvgate.errors import KVGateError, QueueTimeout
from kvgate.server.errors import error_body, status_of
from kvgate.server.serving import ServingContext
from kvgate.server.streaming import SSE_DONE, EventStream, sse, unless_disconnected
from kvgate.server.tracker import ChoiceResult, Tracker, profile_headers


async def run_merged(
    engine: EngineFront,
    requests: Sequence[Request],
    watch: Callable[[int], OnAbandoned] | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Deltas of all ``requests`` as (choice index, delta), each choice's in order.

    Leaving early (a disconnect cancels the consumer) aborts every choice still running;
    ``watch(i)``, called as choice ``i``'s engine stream starts, gives what the engine is to
    tell if it ends unread (what it generated, ``Tracker.watch``).
    """

    def stream(index: int) -> AsyncIterator[RequestOutput]:
        told = watch(index) if watch is not None else None
        return engine.stream(requests[index], told)

    if len(requests) == 1:
        async for out in stream(0):
            yield 0, out
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for out in stream(index):
                await merged.put((index, out))
        except Exception as exc:
            await merged.put((index, exc))
        else:
            await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(requests))]
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
        async for i, out in run_merged(ctx.engine, requests, tracker.watch):
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
        async for i, out in run_merged(ctx.engine, requests, tracker.watch):
            tracker.on_output(i, out)
    except KVGateError as exc:
        tracker.error = exc.code
        if isinstance(exc, QueueTimeout):
            ctx.governance.count_refusal(requests[0].tenant, exc.code)
        raise
    return tracker.results
