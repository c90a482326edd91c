"""The HTTP server's settings: uvicorn, with a header timeout and a connection limit.

uvicorn times out idle keep-alive connections but not a request whose headers never finish
(any byte received cancels its keep-alive timer), so one client holding connections open
with half-sent headers held them for as long as it liked (observed: still open after 111 s).
``HeaderTimeoutProtocol`` closes a connection whose request headers are not complete within
``header_timeout`` seconds of the connection opening or of the previous response ending.
Body stalls are the app's business (``limits.GuardMiddleware``: 408).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvgate.server.limits import RequestLimits


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout = 10.0  # set per server by ``protocol_for``

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
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
        if not self.transport.is_closing():
            self._arm()  # the next request's headers get the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def protocol_for(limits: RequestLimits) -> type[HeaderTimeoutProtocol]:
    return type(
        "HeaderTimeoutProtocol",
        (HeaderTimeoutProtocol,),
        {"header_timeout": limits.header_timeout},
    )


def uvicorn_config(
    app: Any, host: str, port: int, limits: RequestLimits, **kwargs: Any
) -> uvicorn.Config:
    """uvicorn's settings for ``app``: the header timeout, ``max_connections`` (requests on
    connections past it get 503), no uvicorn access log (ours is JSON lines)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_for(limits),
        limit_concurrency=limits.max_connections,
        access_log=False,
        **kwargs,
    )
