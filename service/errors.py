"""Error types of the service and the one place that turns them into HTTP responses.

Every error the API returns is JSON `{"error": {"type", "message", "param"?}}` with the status
in `STATUS`. The exceptions are raised anywhere (the edge, the batcher, a model replica) and
pickle across Ray: their constructor arguments are kept in `args`. Bad input is never a 500;
an unexpected exception is a 500 with a generic message (the traceback goes to the log only).
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

log = logging.getLogger(__name__)

# error type -> HTTP status
STATUS: dict[str, int] = {
    "invalid_request_error": 422,
    "not_found_error": 404,
    "method_not_allowed_error": 405,
    "request_too_large": 413,
    "overloaded_error": 503,
    "model_not_ready": 503,
    "timeout_error": 504,
    "internal_error": 500,
}
RETRY_LATER = frozenset({"overloaded_error", "model_not_ready"})  # answered with Retry-After


class ServiceError(Exception):
    """Base of the errors the API reports; `type` selects the status in STATUS."""

    type: ClassVar[str] = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message

    @property
    def status(self) -> int:
        return STATUS[self.type]

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.param is not None:
            error["param"] = self.param
        return {"error": error}


class InvalidRequest(ServiceError):
    """Wrong types, empty or too many inputs, text over the model's limit, unknown model or language pair."""

    type = "invalid_request_error"


class InvalidItem(ServiceError):
    """One input of a request is unusable (it breaks the tokenizer, it is too long). Raised where the
    HTTP field name is unknown (a model replica); the edge turns it into InvalidRequest naming
    `<field>[index]`."""

    type = "invalid_request_error"

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message, None)
        self.args = (message, index)
        self.index = index


class NotFound(ServiceError):
    type = "not_found_error"


class MethodNotAllowed(ServiceError):
    type = "method_not_allowed_error"


class PayloadTooLarge(ServiceError):
    type = "request_too_large"


class Overloaded(ServiceError):
    """A bounded queue is full: answer at once with 503 + Retry-After rather than queue without bound."""

    type = "overloaded_error"


class NotReady(ServiceError):
    """The model deployment has no loaded replica yet (or it failed to start)."""

    type = "model_not_ready"


class DeadlineExceeded(ServiceError):
    type = "timeout_error"


class InternalError(ServiceError):
    type = "internal_error"


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
