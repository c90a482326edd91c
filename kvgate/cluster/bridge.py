"""One HTTP request, as the ingress received it, run through a replica's kvgate app in
process (its ASGI callable), its response streamed back in parts.

The ingress forwards ``Forwarded`` (method, path, headers, body) and gets back, as a
stream: one ``Head`` (status and headers), then the body's chunks as they are sent (an SSE
stream's events one by one). If the stream is cancelled (the client left the ingress), the
app sees ``http.disconnect`` and its task is cancelled: the same path as a client leaving a
plain ``kvgate serve``, so the engine aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class Forwarded:
    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class Head:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]


def _scope(req: Forwarded) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode(),
        "root_path": "",
        "query_string": req.query,
        "headers": list(req.headers),
        "client": req.client,
        "server": ("kvgate-replica", 0),
        "state": {},
    }


async def run_asgi(app: ASGIApp, req: Forwarded) -> AsyncIterator[Head | bytes]:
    """The response to ``req`` from ``app``: a ``Head``, then body chunks."""
    parts: asyncio.Queue[Head | bytes | None] = asyncio.Queue()
    body_sent = False
    disconnected = asyncio.Event()

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
            await parts.put(Head(message["status"], headers))
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            if chunk:
                await parts.put(bytes(chunk))
            if not message.get("more_body", False):
                await parts.put(None)

    async def call() -> None:
        try:
            await app(_scope(req), receive, send)
        finally:
            await parts.put(None)

    task = asyncio.ensure_future(call())
    try:
        while True:
            part = await parts.get()
            if part is None:
                break
            yield part
        await task  # its exception, if it raised one after the response ended
    finally:
        disconnected.set()
        if not task.done():
            # The consumer left: let the app see the disconnect, then stop it.
            await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
