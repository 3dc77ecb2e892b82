"""The one place that turns errors into HTTP responses: the JSON error shape with its status and,
for a 503, Retry-After; FastAPI's validation and routing errors in the same shape (the error types
themselves are in service/errors.py)."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from ..errors import (
    RETRY_LATER,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ServiceError,
)

log = logging.getLogger(__name__)

def error_response(err: ServiceError, retry_after_s: float) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if err.type in RETRY_LATER else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    """('body', 'inputs', 3) -> 'inputs[3]'; ('body',) -> None."""
    parts = [p for p in loc if p != "body"]
    if not parts:
        return None
    out = str(parts[0])
    for p in parts[1:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def from_validation_error(exc: RequestValidationError) -> InvalidRequest:
    """FastAPI/pydantic validation errors -> one InvalidRequest naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return InvalidRequest("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return InvalidRequest(f"the request body is not valid JSON: {detail}".rstrip(": "))
    param = _param(tuple(first.get("loc", ())))
    message = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        message = "unknown field"
    elif first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        message = str(first["ctx"]["error"])  # our validator's own words, without pydantic's "Value error, "
    return InvalidRequest(f"{param}: {message}" if param else f"request body: {message}", param)


def install_error_handlers(app: FastAPI, retry_after_s: float) -> None:
    """Every error leaves as the JSON error shape; unexpected ones as a generic 500."""

    async def on_service_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServiceError)
        return error_response(exc, retry_after_s)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(from_validation_error(exc), retry_after_s)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        by_status: dict[int, type[ServiceError]] = {404: NotFound, 405: MethodNotAllowed, 413: PayloadTooLarge}
        cls = by_status.get(exc.status_code, InvalidRequest if exc.status_code < 500 else InternalError)
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        response = error_response(cls(message), retry_after_s)
        response.headers.update(exc.headers or {})  # e.g. the Allow header of a 405 (RFC 9110)
        return response

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(InternalError("internal error; see the server log"), retry_after_s)

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
