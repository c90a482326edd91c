"""The HTTP server's settings: uvicorn, with a header timeout, early-response closes and
connection limits (all, and per client address).

uvicorn times out idle keep-alive connections but not a request whose headers never finish
(any byte received cancels its keep-alive timer), so one client holding connections open
with half-sent headers held them for as long as it liked (observed: still open after 111 s).
``GuardedH11Protocol``:

- closes a connection whose request headers are not complete within ``header_timeout``
  seconds of the connection opening or of the previous response ending;
- closes a connection whose response is complete while its request's body is still arriving
  (a path that answers 403/404/405 without reading the body: uvicorn drops the rest of the
  body as it comes, so a byte every few seconds into ``POST /metrics`` held the connection
  for ever, neither idle nor in a request the header or body timers watch);
- refuses a connection past ``max_connections_per_client`` from one address at once (503,
  closed), before it takes one of the server's ``max_connections`` slots for long.

Body stalls, whole-body deadlines and rates are the app's business (``limits.GuardMiddleware``:
408), since the 408 goes out as the app reads.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvgate.server.limits import RequestLimits


class ClientCounts:
    """Open connections per client address, for one server (its event loop's thread only)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[str, int] = {}

    def take(self, host: str) -> bool:
        """Count one more connection from ``host``; False (not counted) past the cap."""
        held = self._open.get(host, 0)
        if held >= self.cap:
            return False
        self._open[host] = held + 1
        return True

    def give(self, host: str) -> None:
        held = self._open[host] - 1
        if held:
            self._open[host] = held
        else:
            del self._open[host]  # so the map holds only addresses with connections open

    def open_from(self, host: str) -> int:
        return self._open.get(host, 0)


def _busy_response(cap: int) -> bytes:
    """The whole 503 for a connection past its address's cap, OpenAI-shaped."""
    message = f"too many connections from this address (at most {cap} at once)"
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "server_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """See the module docstring; ``protocol_for`` makes one subclass per server."""

    header_timeout = 10.0  # set per server by ``protocol_for``, as is:
    clients: ClientCounts

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        host = self.client[0] if self.client else None  # None on a Unix socket: not capped
        self._host = host if host is not None and self.clients.take(host) else None
        if host is not None and self._host is None:
            # Written before the request is read: the client's request, whenever it comes,
            # costs nothing more than this one write; and not counted against
            # ``max_connections`` meanwhile, so a flood of refused ones takes no one's slot.
            self.connections.discard(self)
            self.transport.write(_busy_response(self.clients.cap))
            self.transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        scope = self.scope
        super().handle_events()
        if self.scope is not scope:  # a request's headers arrived whole
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY:
            # Answered before the body was read whole: the rest is never read, so the
            # connection would only wait on it.
            self.transport.close()
            return
        self._arm()  # the next request's headers get the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._host is not None:
            self.clients.give(self._host)
            self._host = None
        super().connection_lost(exc)


def protocol_for(limits: RequestLimits) -> type[GuardedH11Protocol]:
    """A protocol class for one server: its header timeout, and its own per-client counts."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout": limits.header_timeout,
            "clients": ClientCounts(limits.per_client_connections),
        },
    )


def uvicorn_config(
    app: Any, host: str, port: int, limits: RequestLimits, **kwargs: Any
) -> uvicorn.Config:
    """uvicorn's settings for ``app``: the header timeout and connection caps,
    ``max_connections`` (requests on connections past it get 503), no uvicorn access log
    (ours is JSON lines)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_for(limits),
        limit_concurrency=limits.max_connections,
        access_log=False,
        **kwargs,
    )
