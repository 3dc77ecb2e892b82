"""The nginx configuration of the front (service/front/), rendered from plain values (pure functions).

`nginx.conf` is written once; `upstreams.conf` (the ingress targets) is rewritten and reloaded when
Serve's ingress replicas change. HTTP/1.1 keep-alive upstream and no buffering, so SSE streams pass
token by token; `proxy_ignore_client_abort off`, so a client's hang-up cancels its request; Serve's
own proxy as the `backup` server, for a replaced replica's refused port (`proxy_next_upstream error
timeout` retries only what never reached an upstream); the answers nginx gives itself carry our JSON
error shape (service/errors.py) and one `ANSWER_TAG status path` line on stdout, which answers.py
counts for /metrics; no access log (the ingress logs every request), errors to stderr.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import (
    RETRY_LATER,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    NotReady,
    PayloadTooLarge,
    ServiceError,
)
from ..telemetry.logs import MAX_REQUEST_ID
from .answers import ANSWER_TAG

UPSTREAMS = "upstreams.conf"
UPSTREAM = "ingress"
LOST = "the service's ingress is not reachable (starting, or being replaced); retry later"
HEADER_BUFFER = "64k"  # the longest request line or header line (a long bearer token fits)
# What nginx answers itself, as (status, our error): 502 (no upstream answered, or one died while
# answering) and 503 (none usable) as our 503 + Retry-After; 504 (an upstream silent past
# proxy_read_timeout); requests it cannot parse or take (400, 408, 494: a header over
# HEADER_BUFFER, sent as 431); 500. 413 (a body over the limit) is added with the limit's size. A
# request line over HEADER_BUFFER keeps nginx's own 414 page (an error page cannot be served for it).
ERRORS: dict[int, tuple[int, ServiceError]] = {
    400: (400, InvalidRequest("the request is not valid HTTP/1.1")),
    408: (408, DeadlineExceeded("the request was not received in time")),
    494: (431, PayloadTooLarge(f"a request header is over {HEADER_BUFFER}B")),
    500: (500, InternalError("internal error")),
    502: (503, NotReady(LOST)),
    503: (503, NotReady(LOST)),
    504: (504, DeadlineExceeded("the service did not answer in time")),
}
BODY_TOO_LARGE = 413
# The statuses of nginx's own answers (the ones above, a body over the limit): what answers.py counts,
# each exported at 0 from the front's start
ANSWERED: tuple[int, ...] = tuple(sorted({code for code, _ in ERRORS.values()} | {BODY_TOO_LARGE}))


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class FrontConfig:
    listen: Address  # where clients connect
    backup: Address  # Serve's own proxy
    run_dir: Path  # nginx's prefix: its pid file, temp files and our two config files
    max_body_bytes: int  # the ingress's own limit (Settings.max_body_bytes): 413 past it
    retry_after_s: int
    workers: int = 1  # 2 were no faster (docs/benchmarks.md, "Front and request path")
    read_timeout_s: int = 3600  # silence allowed between an upstream's bytes (a stream's tokens)
    body_timeout_s: int = 10  # silence allowed between a client's body bytes (Settings.body_timeout_s): 408


def _quoted(text: str) -> str:
    """`text` as an nginx string literal; nginx has no escape for `$` (a variable), so none may appear."""
    if "$" in text:
        raise ValueError(f"a `$` cannot appear in an nginx string: {text!r}")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _error_location(status: int, answer: tuple[int, ServiceError], retry_after_s: int) -> str:
    code, error = answer
    body = json.dumps(error.body(), separators=(",", ":"))
    retry = f"            add_header Retry-After {retry_after_s} always;\n" if error.type in RETRY_LATER else ""
    return (f"        location @error{status} {{\n"
            "            default_type application/json;\n"
            "            add_header X-Request-ID $ts_request_id always;\n"
            "            access_log /dev/stdout ts_answer;\n"
            f"{retry}"
            f"            return {code} {_quoted(body)};\n"
            "        }\n")


def render_nginx(cfg: FrontConfig) -> str:
    """nginx.conf for `cfg` (it includes UPSTREAMS from the same directory)."""
    too_large = PayloadTooLarge(f"the request body is over the limit of {cfg.max_body_bytes} bytes")
    errors = {**ERRORS, BODY_TOO_LARGE: (BODY_TOO_LARGE, too_large)}
    temp = "\n".join(f"    {kind}_temp_path {_quoted(str(cfg.run_dir / kind))};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    # `::` alone would be IPv6 only in nginx, where Serve's servers on `::` took IPv4 too
    dual = " ipv6only=off" if cfg.listen.host == "::" else ""
    pages = "\n".join(f"        error_page {status} = @error{status};" for status in sorted(errors))
    locations = "".join(_error_location(status, error, cfg.retry_after_s) for status, error in sorted(errors.items()))
    return f"""# Written by service/front/ at start-up; the upstreams follow Serve's ingress replicas.
worker_processes {cfg.workers};
pid {_quoted(str(cfg.run_dir / "nginx.pid"))};
events {{
    worker_connections 8192;
}}
http {{
    access_log off;
    log_format ts_answer '{ANSWER_TAG} $status $uri';
{temp}
    # the client's request id when it is one the service accepts (service/telemetry/logs.py), else nginx's
    map $http_x_request_id $ts_request_id {{
        "~^[A-Za-z0-9._:;=+/@-]{{1,{MAX_REQUEST_ID}}}$" $http_x_request_id;
        default $request_id;
    }}
    include {_quoted(str(cfg.run_dir / UPSTREAMS))};
    server {{
        listen {cfg.listen} backlog=4096{dual};
        client_max_body_size {cfg.max_body_bytes};
        client_body_timeout {cfg.body_timeout_s}s;
        large_client_header_buffers 4 {HEADER_BUFFER};
        proxy_request_buffering off;
        proxy_buffering off;
        proxy_http_version 1.1;
        server_tokens off;
        proxy_set_header Connection "";
        proxy_set_header Host $http_host;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        proxy_set_header X-Forwarded-Proto $scheme;
        proxy_ignore_client_abort off;
        proxy_connect_timeout 2s;
        proxy_send_timeout {cfg.read_timeout_s}s;
        proxy_read_timeout {cfg.read_timeout_s}s;
        proxy_next_upstream error timeout;
{pages}
        location / {{
            proxy_pass http://{UPSTREAM};
        }}
{locations}    }}
}}
"""


def render_upstreams(targets: Sequence[Address], backup: Address) -> str:
    """UPSTREAMS: the ingress replicas, least connections first; Serve's proxy as the backup (alone when
    no replica is running, or when the targets are the proxy itself)."""
    primary = [t for t in dict.fromkeys(targets) if t != backup]
    # a replica that refused a connection is skipped for 1 s (its port is gone until the next poll)
    servers = [f"    server {t} max_fails=1 fail_timeout=1s;" for t in primary]
    servers.append(f"    server {backup} max_fails=0{' backup' if primary else ''};")
    return ("upstream " + UPSTREAM + " {\n    least_conn;\n" + "\n".join(servers)
            + "\n    keepalive 64;\n    keepalive_timeout 60s;\n}\n")
