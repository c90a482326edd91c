"""Request ids and the JSON-lines access log, as one pure ASGI middleware.

Every response carries ``x-request-id`` (the client's, when it sent one) and, once a model
was chosen for it, ``x-kvgate-model-version`` (its lineage id). Handlers fill in the
request's ``AccessRecord`` (tenant, token counts, time to first token, finish reason); the
middleware writes one JSON line when the response is over: after the last byte of a stream,
or when the client went away mid-stream (``"disconnected": true``).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("kvgate.access")

# A client-chosen id is echoed and logged: keep it short and printable.
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass
class AccessRecord:
    request_id: str
    tenant: str | None = None
    model: str | None = None
    #: The served model's lineage id; also sent as the ``x-kvgate-model-version`` header.
    model_version: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    #: The engine's timeline of the (first) choice: queued, prefilling, decoding.
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    #: Arrival at the server to admission (key, body, templating, tokenizing, the gates),
    #: and arrival to the first bytes of the body handed to the connection: with ``ttft_s``
    #: (admission to the first token) they say where a slow first token spent its time.
    door_s: float | None = None
    first_byte_s: float | None = None
    #: When the request arrived (``time.monotonic()``); not logged.
    received: float = field(default_factory=time.monotonic, repr=False)


def access_record(request: Request) -> AccessRecord:
    """The record the middleware attached to this request."""
    record: AccessRecord = request.state.access
    return record


def request_id_of(request: Request) -> str:
    return access_record(request).request_id


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        request_id = given if given and _SAFE_ID.match(given) else uuid.uuid4().hex
        record = AccessRecord(request_id)
        scope.setdefault("state", {})["access"] = record
        start = time.perf_counter()
        status = 0
        done = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode()))
                if record.model_version is not None:
                    headers.append((b"x-kvgate-model-version", record.model_version.encode()))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                if record.first_byte_s is None and message.get("body"):
                    record.first_byte_s = round(time.monotonic() - record.received, 4)
                done = not message.get("more_body")
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            line: dict[str, Any] = {
                "ts": round(time.time(), 3),
                "method": scope.get("method"),
                "path": scope.get("path"),
                "status": status,
                "duration_s": round(time.perf_counter() - start, 4),
                **{k: v for k, v in asdict(record).items() if v is not None and k != "received"},
            }
            if not done:
                line["disconnected"] = True
            access_log.info(json.dumps(line, ensure_ascii=False))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None
