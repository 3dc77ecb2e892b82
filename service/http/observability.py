"""`Observability`, the outermost ASGI middleware of the API (service/http/api.py): each request's id,
metrics and access-log line.

- id: a valid `X-Request-ID` (service/telemetry/logs.py) is kept, else replaced by a fresh one; it is
  set for the request's logs and returned on every response, errors included (behind Serve's proxy,
  which already echoes the header, only when it was replaced);
- metrics (service/telemetry/metrics.py), labelled by `endpoint`: the route's path or "other"; the
  API's routes are exported at 0 from the first request on (`ServiceMetrics.routes_known`), that
  first scrape of /metrics included;
- an access-log line per request only when `access_log` is on;
- an unexpected exception becomes the generic JSON 500 here, so it carries the id too;
- a failing `receive` is the client gone (Serve cancels it on disconnect): the app gets `http.disconnect`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import InternalError
from ..telemetry.endpoints import endpoint_label, is_api
from ..telemetry.logs import REQUEST_ID, new_request_id, valid_request_id
from ..telemetry.metrics import ServiceMetrics
from .errors import error_response

REQUEST_ID_HEADER = "X-Request-ID"
log = logging.getLogger(__name__)
access_log = logging.getLogger("service.access")


def printable(path: str) -> str:
    """A request path as it may appear in a log line: control and non-ASCII characters escaped
    (`\\n`, `\\x1b`, `\\u00e9`), so a client cannot forge log lines or terminal escapes."""
    return path.encode("unicode_escape").decode("ascii")


def _error_type(body: bytes) -> str:
    """The `error.type` of a JSON error body, or "unknown"."""
    try:
        kind = json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return "unknown"
    return kind if isinstance(kind, str) and kind.isidentifier() else "unknown"


class Observability:
    """ASGI middleware; see the module docstring. `endpoints()` lists the API's paths (read at the
    first request, once every route exists)."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, endpoints: Callable[[], Collection[str]],
                 retry_after_s: float, access_log: bool = False, proxy_echoes_id: bool = False) -> None:
        self.app, self.metrics, self.retry_after_s = app, metrics, retry_after_s
        self.access_log, self.proxy_echoes_id = access_log, proxy_echoes_id
        self._endpoints_fn = endpoints
        self._endpoints: frozenset[str] | None = None

    def endpoint(self, path: str) -> str:
        if self._endpoints is None:
            self._endpoints = frozenset(self._endpoints_fn())
            self.metrics.routes_known(self._endpoints)
        return endpoint_label(path, self._endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = dict(scope["headers"]).get(REQUEST_ID_HEADER.lower().encode())
        incoming = raw.decode("latin-1") if raw is not None else None
        rid = valid_request_id(incoming) or new_request_id()
        echo = not self.proxy_echoes_id or rid != incoming
        endpoint = self.endpoint(scope["path"])
        status, started, response_started, reject_reason = 500, time.perf_counter(), False, None

        async def observed_send(message: Message) -> None:
            nonlocal status, response_started, reject_reason
            if message["type"] == "http.response.start":
                status, response_started = message["status"], True
                if echo:
                    MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            elif message["type"] == "http.response.body" and status == 503 and reject_reason is None:
                reject_reason = _error_type(message.get("body", b""))
            await send(message)

        async def guarded_receive() -> Message:
            try:
                return await receive()
            except Exception as exc:  # noqa: BLE001 - whatever the transport raises, the client is gone
                log.debug("receive failed (%s): the client disconnected", type(exc).__name__)
                return {"type": "http.disconnect"}

        token = REQUEST_ID.set(rid)
        self.metrics.request_started(endpoint)
        try:
            await self.app(scope, guarded_receive, observed_send)
        except Exception:
            log.exception("unexpected error on %s %s", scope["method"], printable(scope["path"]))
            if response_started:
                raise
            await error_response(InternalError("internal error; see the server log"), self.retry_after_s)(
                scope, receive, observed_send)
        finally:
            seconds = time.perf_counter() - started
            refused = reject_reason if status == 503 and is_api(endpoint) else None
            self.metrics.request_finished(endpoint, status, seconds, refused)
            if self.access_log:
                path = printable(scope["path"])
                access_log.info("%s %s %d %.1f ms", scope["method"], path, status, seconds * 1000,
                                extra={"request_id": rid, "method": scope["method"], "path": path,
                                       "status": status, "duration_ms": round(seconds * 1000, 3)})
            REQUEST_ID.reset(token)
