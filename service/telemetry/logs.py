"""Structured logs: one JSON object per line, with the id of the request being served.

The ingress sets `REQUEST_ID` for each request (service/http/observability.py) from a valid
`X-Request-ID` header, or a fresh id; every line logged while serving it carries `request_id`.
In a model replica, where the request arrived through a Ray Serve handle, the id is Serve's request
id (the same X-Request-ID, which Serve's proxy passes along). `configure_logging` is called once
per process (`python -m service`, each replica's constructor); nothing happens at import.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid
from typing import Any

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
MAX_REQUEST_ID = 128
_VALID_ID = re.compile(rf"[A-Za-z0-9._:;=+/@-]{{1,{MAX_REQUEST_ID}}}")
# attributes every LogRecord has: anything else on a record was passed with `extra=` and is logged
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def valid_request_id(value: str | None) -> str | None:
    """`value` when it can serve as a request id (1 to 128 characters out of letters, digits and
    `._:;=+/@-`), else None."""
    return value if value is not None and _VALID_ID.fullmatch(value) else None


def new_request_id() -> str:
    return uuid.uuid4().hex


def current_request_id() -> str | None:
    """The id of the request this code serves: set by the ingress, else Serve's (in a replica)."""
    rid = REQUEST_ID.get()
    if rid is None and "ray.serve" in sys.modules:  # a replica: never import Ray from here
        try:
            from ray.serve import context

            serve_context = context._serve_request_context.get()
            rid = (serve_context.request_id or None) if serve_context is not None else None
        except Exception:  # outside a request, or Serve's private API moved
            rid = None
    return rid


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "message", "request_id"?, "exc_info"?, **extra}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or current_request_id()
        if rid is not None:
            out["request_id"] = rid
        for key, value in vars(record).items():  # `extra=` fields (not Ray's private _ray_* ones)
            if key not in _STANDARD and key not in out and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class PlainFormatter(logging.Formatter):
    """`<time> <level> <logger> [<request_id>]: <message>`; `[-]` outside a request."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.request_id = getattr(record, "request_id", None) or current_request_id() or "-"
        return super().format(record)


class _OurHandler(logging.StreamHandler):
    """Marks the handler configure_logging installed, so a second call replaces it."""


def configure_logging(json_logs: bool = True, level: int | str = logging.INFO) -> None:
    """One stderr handler on the root logger: JSON lines (or plain text with the request id).

    It writes to the process's own stderr (`sys.__stderr__`), not to whatever `sys.stderr` is now:
    in throughput mode Ray Serve replaces a replica's `sys.stderr` with a stream into its own logger,
    whose file handler buffers 1,000 records (flushed early only by its own ERROR records), so our
    lines, tracebacks included, reached no log file, and were lost when the replica died. On the real
    stderr they go to Ray's worker log (`logs/worker-*.err`) and on to the driver's console at once."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _OurHandler)]:
        root.removeHandler(handler)
    handler = _OurHandler(sys.__stderr__ or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_logs else PlainFormatter())
    root.addHandler(handler)
    root.setLevel(level)


def serve_logging_config(json_logs: bool, access_log: bool) -> dict[str, Any]:
    """Ray Serve's LoggingConfig for every deployment (and Serve's proxy): JSON lines carrying Serve's
    request id (= X-Request-ID), and Serve's per-request access lines only when asked for."""
    return {"encoding": "JSON" if json_logs else "TEXT", "enable_access_log": access_log}
