"""The OpenAI-compatible ingress of the Ray Serve application: every HTTP request is
forwarded, as it came, to one engine replica through the engine deployment's handle, whose
router (``router.py``) picks the replica by prefix-cache affinity balanced against load.

The ingress reads the body (up to ``max_body_bytes``: 413 past it, before any replica is
asked), hashes the prompt's leading blocks for the router, and streams the replica's
response back as it comes. ``/metrics`` is every replica's, labelled ``replica``.

Failures: a replica that dies before its response begins is retried once on another; one
that dies mid-stream ends an SSE stream with an ``error`` event (never a hang); a client
that leaves cancels the replica's call, which aborts the engine request there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvgate.cluster.affinity import request_keys
from kvgate.cluster.bridge import Forwarded, Head
from kvgate.cluster.controller import ENGINE, PROBE_HEADER
from kvgate.cluster.rollout import CANARY, STABLE, arm_for
from kvgate.cluster.router import RouteHint

log = logging.getLogger("kvgate.cluster")

#: Header a client may send to be served by one model version only, during a rollout
#: (its value: a version id, as /v1/models and every response's header give it).
VERSION_HEADER = "x-kvgate-model-version"


def _error(status: int, message: str, code: str, err_type: str = "server_error") -> Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    headers = {"Retry-After": "1"} if status == 503 else {}
    return JSONResponse(body, status_code=status, headers=headers)


def _sse_error(message: str) -> bytes:
    error = {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}
    return f"data: {json.dumps({'error': error})}\n\n".encode()


class Ingress:
    """``engine``: the engine deployment bound in the same application (``serve run``);
    None: the engine applications the rollout controller names (``kvgate serve
    --replicas``)."""

    def __init__(self, engine: Any = None, max_body_bytes: int = 4 * 2**20) -> None:
        from kvgate.cluster.controller import controller_actor

        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.controller = controller_actor()
        self.routing: dict[str, Any] = {}
        self.routing_at = 0.0
        self.handles: dict[str, Any] = {}
        self.outcomes: list[tuple[str, bool, float | None, tuple[float, ...]]] = []
        self._sync = asyncio.ensure_future(self._keep_in_sync())

    async def _keep_in_sync(self) -> None:
        """Twice a second: the controller's routing in, the requests' outcomes out."""
        while True:
            with contextlib.suppress(Exception):  # the controller restarting: next time
                outcomes, self.outcomes = self.outcomes, []
                if outcomes:
                    self.controller.report.remote(outcomes)
                self.routing = await self.controller.routing.remote()
                self.routing_at = time.monotonic()
            await asyncio.sleep(SYNC_S)

    def _handle(self, arm: str) -> Any:
        app_name = self.routing.get(arm)
        if app_name is None:
            if arm == STABLE and self.engine is not None:
                return self.engine
            raise LookupError("no engine application is serving yet")
        handle = self.handles.get(app_name)
        if handle is None:
            from ray import serve

            handle = self.handles[app_name] = serve.get_deployment_handle(ENGINE, app_name)
        return handle

    def _arm(self, request: Request) -> str:
        if not self.routing.get(CANARY):
            return STABLE
        if time.monotonic() - self.routing_at > STALE_S:
            return STABLE  # the controller not answering: its canary may be gone by now
        pinned = request.headers.get(VERSION_HEADER)
        for arm, version in self.routing.get("versions", {}).items():
            if pinned is not None and pinned == version:
                return str(arm)
        client = request.headers.get("authorization") or (
            request.client.host if request.client else ""
        )
        return arm_for(float(self.routing.get("weight", 0.0)), client, self.routing.get("salt", ""))

    async def _body(self, request: Request) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def __call__(self, request: Request) -> Response:
        if not self.routing and self.engine is None:  # just started: ask, do not guess
            with contextlib.suppress(Exception):
                self.routing = await self.controller.routing.remote()
                self.routing_at = time.monotonic()
        if request.url.path == "/metrics" and request.method == "GET":
            return await self._metrics(request)
        body = await self._body(request)
        if body is None:
            return _error(
                413,
                f"request body over {self.max_body_bytes} bytes",
                "request_too_large",
                "invalid_request_error",
            )
        arm = self._arm(request)
        hint = RouteHint(self._keys(request, body), None)
        client = request.client
        forwarded = Forwarded(
            request.method,
            request.url.path,
            request.url.query.encode(),
            # Only the controller marks a request as its own probe.
            tuple((k, v) for k, v in request.headers.raw if k != PROBE_HEADER),
            body,
            (client.host, client.port) if client is not None else None,
        )
        start = time.perf_counter()
        for attempt in range(2):
            try:
                stream = (
                    self._handle(arm)
                    .options(stream=True)
                    .handle.remote(forwarded, route=hint.wire())
                )
                head = await stream.__anext__()
            except StopAsyncIteration:
                self._outcome(arm, True, None, ())
                return _error(502, "the replica sent no response", "replica_failed")
            except Exception as exc:  # the replica died or is gone: once more, elsewhere
                with contextlib.suppress(Exception):
                    stream.cancel()
                log.warning("replica failed before responding (%s): %s", type(exc).__name__, exc)
                if attempt == 0:
                    continue
                self._outcome(arm, True, None, ())
                return _error(503, "no replica could serve the request; retry", "replica_failed")
            break
        response = StreamingResponse(self._rest(stream, head, arm, start), status_code=head.status)
        response.raw_headers = list(head.headers)
        return response

    def _outcome(self, arm: str, failed: bool, ttft: float | None, gaps: tuple[float, ...]) -> None:
        if len(self.outcomes) < 100_000:  # the controller away for long: keep the newest
            self.outcomes.append((arm, failed, ttft, gaps))

    @staticmethod
    def _keys(request: Request, body: bytes) -> tuple[int, ...]:
        if request.method != "POST" or not body.startswith(b"{"):
            return ()
        try:
            parsed = json.loads(body)
        except ValueError:
            return ()  # the replica answers the 400
        return request_keys(request.url.path, parsed) if isinstance(parsed, dict) else ()

    async def _rest(self, stream: Any, head: Head, arm: str, start: float) -> AsyncIterator[bytes]:
        # (``head`` may be a copy of ``Head`` unpickled from elsewhere: read, not isinstance)
        sse = any(
            k == b"content-type" and v.startswith(b"text/event-stream") for k, v in head.headers
        )
        failed = head.status >= 500
        ttft: float | None = None
        gaps: list[float] = []
        last = 0.0
        try:
            async for part in stream:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                elif sse and len(gaps) < GAPS_PER_REQUEST:
                    gaps.append(now - last)
                last = now
                if sse and part.startswith(b'data: {"error"'):
                    failed = True
                yield part
        except Exception as exc:
            failed = True
            log.warning("replica failed mid-response (%s): %s", type(exc).__name__, exc)
            if sse:
                yield _sse_error(f"the replica serving this stream failed: {type(exc).__name__}")
        finally:
            stream.cancel()
            self._outcome(arm, failed, ttft, tuple(gaps))

    async def _metrics(self, request: Request) -> Response:
        auth = request.headers.get("authorization")
        try:
            text: bytes = await self._handle(STABLE).cluster_metrics.remote(auth)
        except Exception as exc:
            return _error(503, f"no replica could give its metrics: {exc}", "replica_failed")
        with contextlib.suppress(Exception):
            status = await self.controller.status.remote()
            text += rollout_metrics(status)
        return Response(text, media_type=CONTENT_TYPE_LATEST)


#: Seconds between the ingress's reads of the routing (a rollback takes effect within it).
SYNC_S = 0.5
#: Routing older than this (the controller not answering) sends nothing to a canary: it is
#: deleted ``controller.DELETE_AFTER_S`` after being taken out of the routing.
STALE_S = 2.0
#: Inter-chunk gaps kept per streamed request, for the judge's inter-token p99.
GAPS_PER_REQUEST = 64
ROLLOUT_STATES = ("idle", "loading", "progressing", "promoted", "rolled_back", "rejected")


def rollout_metrics(status: dict[str, Any]) -> bytes:
    lines = [
        "# HELP kvgate:rollout_state The rollout's state (1 for the current one).",
        "# TYPE kvgate:rollout_state gauge",
        *(
            f'kvgate:rollout_state{{state="{s}"}} {1.0 if status["state"] == s else 0.0}'
            for s in ROLLOUT_STATES
        ),
        "# HELP kvgate:rollout_canary_weight Per cent of traffic sent to the canary.",
        "# TYPE kvgate:rollout_canary_weight gauge",
        f"kvgate:rollout_canary_weight {float(status['weight'])}",
        "# HELP kvgate:rollout_decisions Rollout decisions, by decision.",
        "# TYPE kvgate:rollout_decisions counter",
        *(
            f'kvgate:rollout_decisions_total{{decision="{d}"}} {float(n)}'
            for d, n in sorted(status["decisions"].items())
        ),
    ]
    return ("\n".join(lines) + "\n").encode()
