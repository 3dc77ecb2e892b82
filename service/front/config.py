"""The nginx configuration of the front (service/front/), rendered from plain values.

Two files: `nginx.conf` (written once) and `upstreams.conf` (the ingress targets, rewritten and
reloaded when Serve's ingress replicas change). Choices, each for a reason:
- HTTP/1.1 keep-alive to the upstreams, no request or response buffering: streams (SSE) reach the
  client token by token and a request is passed on as it arrives;
- `proxy_ignore_client_abort off` (nginx's default, stated): a client that hangs up closes the
  upstream connection, which Serve turns into a cancelled request (the engine frees its row);
- Serve's own proxy as the `backup` server: a connection refused by a replaced replica's old port
  (between the replacement and the next reload) is retried there, where Serve routes it;
  `proxy_next_upstream error timeout` only retries what never reached an upstream (nginx does not
  retry a POST once it was sent);
- the errors nginx answers itself (no upstream, a body over the limit, an upstream that died while
  answering) carry our JSON error shape (service/errors.py), never nginx's HTML;
- no access log (the ingress logs every request with its id), errors to stderr.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import RETRY_LATER, DeadlineExceeded, NotReady, PayloadTooLarge, ServiceError

UPSTREAMS = "upstreams.conf"
UPSTREAM = "ingress"
# nginx's own failures, as our errors: 502 (no upstream answered, or one died while answering),
# 503 (none usable), 504 (an upstream silent past proxy_read_timeout), 413 (body over the limit).
LOST = "the service's ingress is not reachable (starting, or being replaced); retry later"
ERRORS: dict[int, ServiceError] = {
    502: NotReady(LOST),
    503: NotReady(LOST),
    504: DeadlineExceeded("the service did not answer in time"),
}


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
    workers: int = 1  # one nginx worker outpaces the Python ingress behind it (docs/reliability.md)
    read_timeout_s: int = 3600  # silence allowed between an upstream's bytes (a stream's tokens)


def _quoted(text: str) -> str:
    """`text` as an nginx string literal; nginx has no escape for `$` (a variable), so none may appear."""
    if "$" in text:
        raise ValueError(f"a `$` cannot appear in an nginx string: {text!r}")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _error_location(status: int, error: ServiceError, retry_after_s: int) -> str:
    body = json.dumps(error.body(), separators=(",", ":"))
    retry = f"            add_header Retry-After {retry_after_s} always;\n" if error.type in RETRY_LATER else ""
    return (f"    location @error{status} {{\n"
            "        default_type application/json;\n"
            "        add_header X-Request-ID $request_id always;\n"
            f"{retry}"
            f"        return {error.status} {_quoted(body)};\n"
            "    }\n")


def render_nginx(cfg: FrontConfig) -> str:
    """nginx.conf for `cfg` (it includes UPSTREAMS from the same directory)."""
    errors = {**ERRORS, 413: PayloadTooLarge(f"the request body is over the limit of {cfg.max_body_bytes} bytes")}
    temp = "\n".join(f"    {kind}_temp_path {cfg.run_dir / kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    pages = "\n".join(f"        error_page {status} = @error{status};" for status in sorted(errors))
    locations = "".join(_error_location(status, error, cfg.retry_after_s) for status, error in sorted(errors.items()))
    return f"""# Written by service/front/ at start-up; the upstreams follow Serve's ingress replicas.
worker_processes {cfg.workers};
pid {cfg.run_dir / "nginx.pid"};
events {{
    worker_connections 8192;
}}
http {{
    access_log off;
{temp}
    include {cfg.run_dir / UPSTREAMS};
    server {{
        listen {cfg.listen} backlog=4096;
        client_max_body_size {cfg.max_body_bytes};
        proxy_request_buffering off;
        proxy_buffering off;
        proxy_http_version 1.1;
        server_tokens off;
        proxy_set_header Connection "";
        proxy_set_header Host $http_host;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
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
