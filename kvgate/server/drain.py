"""Graceful drain: on SIGTERM (a rolling restart, a pod being moved) the server stops taking
new requests but finishes the ones it has.

From the first SIGTERM (or SIGINT):
- ``/health`` answers 503 ``{"status": "draining"}``, so a load balancer or Kubernetes'
  readiness probe stops sending it traffic;
- a new API request gets 503 ``server_shutting_down`` with Retry-After (a client or proxy
  retries it elsewhere), before any work is done for it;
- requests in flight, streams included, run to their end, for up to ``shutdown_timeout``
  seconds; then the server exits (what is still running then is cut, as a crash would).
A second signal stops at once.

Only this is new: the listening socket stays open while draining (uvicorn's own shutdown
closes it first, so a probe would see "connection refused" rather than a 503, and nothing
could say why).
"""

from __future__ import annotations

import json
import threading
import time

from starlette.types import ASGIApp, Receive, Scope, Send

#: Paths served while draining (they do no work for a tenant).
_ALWAYS = ("/health", "/health/live", "/metrics")


class Drain:
    def __init__(self) -> None:
        self.draining = threading.Event()
        self._active = 0
        self._idle = threading.Condition()

    @property
    def active(self) -> int:
        """HTTP requests in flight (besides health and metrics)."""
        return self._active

    def begin(self) -> None:
        self.draining.set()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is in flight (True) or ``timeout`` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _enter(self) -> None:
        with self._idle:
            self._active += 1

    def _leave(self) -> None:
        with self._idle:
            self._active -= 1
            if not self._active:
                self._idle.notify_all()


class DrainMiddleware:
    """Counts requests in flight; refuses new ones once draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _ALWAYS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining.is_set():
            body = json.dumps({
                "error": {
                    "message": "the server is shutting down; retry the request",
                    "type": "server_error", "param": None, "code": "server_shutting_down",
                }
            }).encode()  # fmt: skip
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
                (b"connection", b"close"),
            ]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        self.drain._enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain._leave()
