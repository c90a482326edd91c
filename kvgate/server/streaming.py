"""Server-sent events out, and client disconnects noticed for plain (non-streamed) responses."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

T = TypeVar("T")


def sse(data: dict[str, Any]) -> str:
    """One SSE event. ``ensure_ascii=False``: characters go out as UTF-8, whole."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """``text/event-stream`` whose generator is closed however the response ends.

    Closing it runs the generator's cleanup at once, which aborts its engine requests: a client
    that leaves mid-stream stops costing KV blocks now, not when the garbage collector runs.
    """

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        on_close: Callable[[], None] | None = None,
        stalled_timeout: float | None = None,
    ) -> None:
        """``stalled_timeout``: seconds a send may wait for the client to read (the socket's
        buffers full) before the stream is given up: its engine requests are aborted and
        their blocks freed, instead of a slot held for a client that stopped reading."""
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._on_close = on_close
        self._stalled_timeout = stalled_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self._stalled_timeout

        async def bounded_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except TimeoutError:
                raise ClientStalled(f"the client read nothing for {timeout:g} s") from None

        try:
            with contextlib.suppress(ClientStalled):
                await super().__call__(scope, receive, bounded_send if timeout else send)
        finally:
            try:
                await self._events.aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()


class ClientStalled(Exception):
    """The client stopped reading a stream for longer than the stalled-client timeout."""


class ClientDisconnected(Exception):
    """The client went away before a non-streamed response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (aborting its engine
    requests) and raise ``ClientDisconnected``."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()
