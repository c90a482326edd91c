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

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvgate.cluster.affinity import request_keys
from kvgate.cluster.bridge import Forwarded, Head
from kvgate.cluster.router import RouteHint

log = logging.getLogger("kvgate.cluster")

#: Header a client may send to be served by one model version only (see lineage).
VERSION_HEADER = "x-kvgate-model-version"


def _error(status: int, message: str, code: str, err_type: str = "server_error") -> Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    headers = {"Retry-After": "1"} if status == 503 else {}
    return JSONResponse(body, status_code=status, headers=headers)


def _sse_error(message: str) -> bytes:
    error = {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}
    return f"data: {json.dumps({'error': error})}\n\n".encode()


class Ingress:
    def __init__(self, engine: Any, max_body_bytes: int = 4 * 2**20) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes

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
        if request.url.path == "/metrics" and request.method == "GET":
            text = await self.engine.cluster_metrics.remote(request.headers.get("authorization"))
            return Response(text, media_type=CONTENT_TYPE_LATEST)
        body = await self._body(request)
        if body is None:
            return _error(
                413,
                f"request body over {self.max_body_bytes} bytes",
                "request_too_large",
                "invalid_request_error",
            )
        hint = RouteHint(self._keys(request, body), request.headers.get(VERSION_HEADER))
        client = request.client
        forwarded = Forwarded(
            request.method,
            request.url.path,
            request.url.query.encode(),
            tuple(request.headers.raw),
            body,
            (client.host, client.port) if client is not None else None,
        )
        for attempt in range(2):
            stream = self.engine.options(stream=True).handle.remote(forwarded, route=hint.wire())
            try:
                head = await stream.__anext__()
            except StopAsyncIteration:
                return _error(502, "the replica sent no response", "replica_failed")
            except Exception as exc:  # the replica died or is gone: once more, elsewhere
                stream.cancel()
                log.warning("replica failed before responding (%s): %s", type(exc).__name__, exc)
                if attempt == 0:
                    continue
                return _error(503, "no replica could serve the request; retry", "replica_failed")
            break
        response = StreamingResponse(self._rest(stream, head), status_code=head.status)
        response.raw_headers = list(head.headers)
        return response

    @staticmethod
    def _keys(request: Request, body: bytes) -> tuple[int, ...]:
        if request.method != "POST" or not body.startswith(b"{"):
            return ()
        try:
            parsed = json.loads(body)
        except ValueError:
            return ()  # the replica answers the 400
        return request_keys(request.url.path, parsed) if isinstance(parsed, dict) else ()

    @staticmethod
    async def _rest(stream: Any, head: Head) -> AsyncIterator[bytes]:
        # (``head`` may be a copy of ``Head`` unpickled from elsewhere: read, not isinstance)
        sse = any(
            k == b"content-type" and v.startswith(b"text/event-stream") for k, v in head.headers
        )
        try:
            async for part in stream:
                yield part
        except Exception as exc:
            log.warning("replica failed mid-response (%s): %s", type(exc).__name__, exc)
            if sse:
                yield _sse_error(f"the replica serving this stream failed: {type(exc).__name__}")
        finally:
            stream.cancel()
