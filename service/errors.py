"""The error types of the service, free of torch and FastAPI.

They are raised anywhere (the edge, the batcher, the engine, a model replica) and cross from a model
replica to the ingress inside Ray's RayTaskError. Unpickling an exception imports the module that
defines it, so every error a replica raises is defined here, or the ingress would import torch to
read one. Their constructor arguments are kept in `args`, so they pickle whole. Every error the API
returns is JSON `{"error": {"type", "message", "param"?}}` with the status in `STATUS`
(service/http/errors.py writes the responses). Bad input is never a 500; an unexpected exception is
a 500 with a generic message (the traceback goes to the log only).
"""

from __future__ import annotations

from typing import Any, ClassVar

# error type -> HTTP status
STATUS: dict[str, int] = {
    "invalid_request_error": 422,
    "invalid_adapter_error": 400,
    "not_found_error": 404,
    "method_not_allowed_error": 405,
    "request_too_large": 413,
    "request_timeout_error": 408,
    "rate_limit_error": 429,
    "overloaded_error": 503,
    "model_not_ready": 503,
    "timeout_error": 504,
    "internal_error": 500,
}
RETRY_LATER = frozenset({"overloaded_error", "model_not_ready"})  # answered with Retry-After
UNAVAILABLE = tuple(kind for kind, status in STATUS.items() if status == 503)  # the error types of a 503


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

    code: ClassVar[str | None] = None  # OpenAI's machine-readable `code`, where one applies

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.param is not None:
            error["param"] = self.param
        if self.code is not None:
            error["code"] = self.code
        return {"error": error}


class InvalidRequest(ServiceError):
    """Wrong types, empty or too many inputs, text over the model's limit, unknown model or language pair."""

    type = "invalid_request_error"


class GrammarFailed(InvalidRequest):
    """A structured output's grammar refused a token while the text was generated (a grammar its
    matcher cannot follow to the end): the request ends with a 422 (or, streamed, that error as its
    last event), never a 500."""


class InvalidItem(ServiceError):
    """One input of a request is unusable (it breaks the tokenizer, it is too long). Raised where the
    HTTP field name is unknown (a model replica); the edge turns it into InvalidRequest naming
    `<field>[index]`."""

    type = "invalid_request_error"

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message, None)
        self.args = (message, index)
        self.index = index


class RequestTooLarge(InvalidRequest):
    """A generation request over one of the engine's limits; `limit` names the EngineConfig field (-> 422)."""

    def __init__(self, message: str, param: str | None = None, limit: str | None = None) -> None:
        super().__init__(message, param)
        self.args = (message, param, limit)
        self.limit = limit


class NotFound(ServiceError):
    type = "not_found_error"


class ModelNotFound(NotFound):
    """A request's `model` names no model or adapter of its task (OpenAI's 404 model_not_found)."""

    code = "model_not_found"


class InvalidAdapter(ServiceError):
    """A LoRA adapter that cannot be served (its files, its type, its shapes); the message names why."""

    type = "invalid_adapter_error"


class MethodNotAllowed(ServiceError):
    type = "method_not_allowed_error"


class BodyTimeout(ServiceError):
    """A request body not whole within body_timeout_s of the request (a slow or stalled sender)."""

    type = "request_timeout_error"


class PayloadTooLarge(ServiceError):
    type = "request_too_large"


class RateLimited(ServiceError):
    """A tenant over its quota (service/http/quotas.py): 429 with Retry-After, OpenAI's code."""

    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class Overloaded(ServiceError):
    """A bounded queue is full: answer at once with 503 + Retry-After rather than queue without bound."""

    type = "overloaded_error"


class EngineOverloaded(Overloaded):
    """The generation engine's waiting queue holds max_queued requests: 503 + Retry-After."""


class NotReady(ServiceError):
    """The model deployment has no loaded replica yet (or it failed to start)."""

    type = "model_not_ready"


class EngineClosed(NotReady):
    """A generation request submitted after the engine shut down."""


class DeadlineExceeded(ServiceError):
    type = "timeout_error"


class InternalError(ServiceError):
    type = "internal_error"
