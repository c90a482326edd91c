"""The one place where exceptions become HTTP responses in OpenAI's error shape.

``{"error": {"message", "type", "param", "code"}}`` with a string code. The client never sees a
traceback: unexpected exceptions become a 500 with the exception's class name only (the
traceback goes to the server log).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvgate.engine.lora_cache import LoraNotFound
from kvgate.errors import (
    EngineDead,
    InvalidConfig,
    InvalidRequest,
    KVGateError,
    Overloaded,
    PermissionDenied,
    QueueTimeout,
)
from kvgate.governance.admission import RateLimited
from kvgate.retrieval.extra import RetrievalUnavailable
from kvgate.retrieval.service import NotFound

log = logging.getLogger("kvgate.server")


class ModelNotServed(KVGateError):
    code = "model_not_found"

    def __init__(self, model: str, served: str | Sequence[str]) -> None:
        names = ", ".join(repr(n) for n in ([served] if isinstance(served, str) else served))
        super().__init__(
            f"The model {model!r} does not exist; this server serves {names}", param="model"
        )


class ModelNotAllowed(PermissionDenied):
    """A tenant limited to some models (``models`` in the tenants file) asked for another."""

    code = "model_not_allowed"

    def __init__(self, model: str, tenant: str, allowed: Sequence[str]) -> None:
        super().__init__(
            f"tenant {tenant!r} may not use model {model!r}; it may use "
            + ", ".join(repr(m) for m in allowed),
            param="model",
        )


class AuthenticationFailed(KVGateError):
    code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message)


class ModelLoading(KVGateError):
    code = "model_loading"

    def __init__(self, message: str = "the model is still loading; retry shortly") -> None:
        super().__init__(message)


def status_of(exc: KVGateError) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) for a domain exception."""
    if isinstance(exc, InvalidRequest):
        return 400, "invalid_request_error"
    if isinstance(exc, AuthenticationFailed):
        return 401, "authentication_error"
    if isinstance(exc, PermissionDenied):
        return 403, "permission_error"
    if isinstance(exc, (ModelNotServed, NotFound, LoraNotFound)):
        return 404, "invalid_request_error"
    if isinstance(exc, RateLimited):
        return 429, "rate_limit_error"
    if isinstance(exc, (Overloaded, ModelLoading, EngineDead, QueueTimeout)):
        return 503, "server_error"
    if isinstance(exc, InvalidConfig):
        return 400, "invalid_request_error"
    if isinstance(exc, RetrievalUnavailable):
        return 501, "server_error"
    return 500, "server_error"


def error_body(
    message: str, err_type: str, code: str, param: str | None = None
) -> dict[str, dict[str, Any]]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(exc: KVGateError) -> JSONResponse:
    status, err_type = status_of(exc)
    headers = {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(exc.retry_after)
    elif isinstance(exc, RateLimited):
        headers.update(exc.headers)
        headers["Retry-After"] = str(exc.retry_after)
    elif isinstance(exc, QueueTimeout):
        headers["Retry-After"] = "1"
    elif isinstance(exc, ModelLoading):
        headers["Retry-After"] = "5"
    elif isinstance(exc, AuthenticationFailed):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(
        error_body(exc.message, err_type, exc.code, exc.param), status_code=status, headers=headers
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    # loc is ("body", field, ...); a JSON syntax error has loc ("body", position).
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    param = ".".join(loc) if loc else None
    where = f" at '{param}'" if param else ""
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"invalid value{where}: {first.get('msg', 'invalid')}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KVGateError)
    async def _domain(_: Request, exc: KVGateError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(
            error_body(message, "invalid_request_error", "invalid_request_error", param),
            status_code=400,
        )

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            error_body(str(exc.detail), err_type, code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(
                f"internal server error ({type(exc).__name__}); see the server log",
                "server_error",
                "internal_error",
            ),
            status_code=500,
        )
