"""Limits on what one request may make the server do, enforced before the work is done.

``RequestLimits`` holds every limit (each a ``kvgate serve`` flag, defaults documented
there and in docs/operator/settings.md). ``GuardMiddleware`` is the outermost layer of the
app, pure ASGI, so it runs before FastAPI reads or parses a byte of the body:

1. a body over ``max_body_bytes`` is refused with 413, on its ``Content-Length`` before
   reading, or as soon as the bytes received pass the limit (chunked bodies);
2. a body that stalls (no bytes for ``body_timeout`` seconds), takes longer than
   ``body_deadline`` seconds in all, or arrives slower than ``min_body_rate`` bytes/s on
   average once ``body_rate_grace`` seconds have passed is refused with 408 (a per-read
   timeout alone let a byte every few seconds hold a connection for ever);
3. API routes need a valid key before their body is read (401 otherwise): the body of an
   unauthenticated request is never parsed, so it costs its sender, not the server.

Header timeouts, closing a connection whose body is still arriving after an early response,
and the connection limits (all, and per client address) live in the HTTP server
(``server/http.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.errors import InvalidConfig


@dataclass(frozen=True)
class RequestLimits:
    #: Largest request body in bytes (413 above it). 4 MiB holds a 128k-token prompt as text
    #: several times over, or as token ids; a larger body costs the server its reading.
    max_body_bytes: int = 4 * 2**20
    #: Largest file upload (``POST /v1/files``), in bytes (413 above it).
    max_upload_bytes: int = 64 * 2**20
    #: Longest prompt in characters, over all messages and prompts (400 above it, before
    #: tokenizing). None: no cap but the context's own, at the fewest tokens the text can be
    #: (``token_floor.py``), which every prompt meets.
    max_prompt_chars: int | None = None
    #: Most messages in one chat request.
    max_messages: int = 1024
    #: Most stop strings, and the longest one (characters).
    max_stop: int = 16
    max_stop_chars: int = 256
    #: Most ``stop_token_ids``.
    max_stop_token_ids: int = 256
    #: Seconds a client may take to send a request's headers, and to send each chunk of
    #: its body, before the connection is closed (header) or refused with 408 (body).
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    #: Seconds a whole request body may take from the end of its headers (408 past it): the
    #: most a body, however it trickles, holds a connection. 300 s lets a full upload
    #: (``max_upload_bytes``) arrive at 224 KB/s.
    body_deadline: float = 300.0
    #: Slowest average rate a body may arrive at, bytes/s from the end of its headers, checked
    #: once ``body_rate_grace`` seconds have passed (408 below it); 0: no rate check.
    min_body_rate: int = 4096
    body_rate_grace: float = 10.0
    #: Most open connections; requests on connections past it get 503.
    max_connections: int = 1024
    #: Most open connections from one client address: one past it gets 503 and is closed at
    #: once, so one address cannot take every slot. None: a quarter of ``max_connections``.
    #: Behind a proxy every client has the proxy's address: raise it to ``max_connections``.
    max_connections_per_client: int | None = None
    #: Seconds a stream may wait for its client to read before it is aborted (its slot and
    #: KV blocks freed); the output waiting meanwhile is bounded by this time.
    stalled_client_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes", "max_upload_bytes", "max_messages", "max_stop", "max_stop_chars",
            "max_stop_token_ids", "max_connections",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise InvalidConfig(f"{name} must be >= 1, got {getattr(self, name)}", param=name)
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise InvalidConfig("max_prompt_chars must be >= 1", param="max_prompt_chars")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 1:
            raise InvalidConfig(
                "max_connections_per_client must be >= 1", param="max_connections_per_client"
            )
        if self.min_body_rate < 0:
            raise InvalidConfig("min_body_rate must be >= 0", param="min_body_rate")
        for name in (
            "header_timeout", "body_timeout", "body_deadline", "body_rate_grace",
            "stalled_client_timeout",
        ):  # fmt: skip
            if not getattr(self, name) > 0:
                raise InvalidConfig(f"{name} must be > 0, got {getattr(self, name)}", param=name)

    @property
    def per_client_connections(self) -> int:
        """``max_connections_per_client``, or its default."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return max(1, self.max_connections // 4)


#: Paths whose callers must hold a tenant key (when keys exist) before the body is read.
_KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/rerank", "/v2/rerank", "/openapi.json")


def _error(status: int, message: str, err_type: str, code: str, param: str | None) -> bytes:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return json.dumps(body).encode()


async def _send_error(
    send: Send,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _Refused(Exception):
    """Raised from the wrapped ``receive``: the body broke a limit."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


class BodyClock:
    """The time one request's body has left under the three body limits: its stall timeout
    (from the last bytes), its whole-body deadline and its minimum average rate (both from
    the end of the headers), in seconds of the event loop's clock."""

    def __init__(self, limits: RequestLimits, start: float) -> None:
        self.limits = limits
        self.start = start
        self.last = start  # when the previous body bytes arrived

    def left(self, received: int, now: float) -> tuple[float, str]:
        """(seconds until the first limit breaks, what that limit says when it does)."""
        lim = self.limits
        budgets = [
            (self.last + lim.body_timeout - now, f"no bytes for {lim.body_timeout:g} s"),
            (self.start + lim.body_deadline - now, f"longer than {lim.body_deadline:g} s in all"),
        ]
        if lim.min_body_rate:
            # Behind by the time the bytes received would have taken at the minimum rate.
            due = self.start + lim.body_rate_grace + received / lim.min_body_rate
            budgets.append((due - now, f"slower than {lim.min_body_rate} bytes/s"))
        return min(budgets)


def _timed_out(why: str) -> bytes:
    return _error(
        408,
        f"the request body was too slow: {why}",
        "invalid_request_error",
        "request_timeout",
        None,
    )


class GuardMiddleware:
    """See the module docstring. ``key_ok(authorization header or None)``: whether the caller
    may use the API (always true on an open server)."""

    def __init__(
        self, app: ASGIApp, limits: RequestLimits, key_ok: Callable[[str | None], bool]
    ) -> None:
        self.app = app
        self.limits = limits
        self.key_ok = key_ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        upload = path == "/v1/files" and scope.get("method") == "POST"
        limit = self.limits.max_upload_bytes if upload else self.limits.max_body_bytes
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _send_error(send, 413, self._too_large(length.decode("latin-1"), limit))
            return
        if path.startswith(_KEYED_PREFIXES):
            auth = headers.get(b"authorization")
            if not self.key_ok(auth.decode("latin-1") if auth is not None else None):
                message = (
                    "Incorrect API key provided"
                    if auth
                    else "Missing API key: send 'Authorization: Bearer YOUR_KEY'"
                )
                body = _error(401, message, "authentication_error", "invalid_api_key", None)
                await _send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])
                return
        received = 0
        body_done = False  # after the body, receive() only waits for a disconnect: no timeout
        refusal: _Refused | None = None  # set once the body broke a limit
        sent = False  # whether a response has started
        clock = BodyClock(self.limits, asyncio.get_running_loop().time())

        async def guarded_receive() -> Message:
            nonlocal received, refusal, body_done
            if body_done:
                return await receive()
            loop = asyncio.get_running_loop()
            left, why = clock.left(received, loop.time())
            try:
                if left <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                refusal = _Refused(408, _timed_out(why))
                raise refusal from None
            clock.last = loop.time()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    refusal = _Refused(413, self._too_large(f"more than {received}", limit))
                    raise refusal
            return message

        async def guarded_send(message: Message) -> None:
            # FastAPI turns an error raised while it reads the body into its own 400: the
            # refusal's own status and message go out instead.
            nonlocal sent
            if refusal is not None:
                if not sent:
                    sent = True
                    await _send_error(send, refusal.status, refusal.body)
                return
            sent = sent or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except _Refused:
            pass
        except Exception:
            if refusal is None:
                raise
        if refusal is not None and not sent:
            await _send_error(send, refusal.status, refusal.body)

    def _too_large(self, size: str, limit: int) -> bytes:
        return _error(
            413,
            f"request body of {size} bytes is over the limit of {limit} bytes",
            "invalid_request_error",
            "request_too_large",
            None,
        )
