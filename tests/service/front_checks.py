"""The nginx binary for the tests of the front (service/front/).

Without nginx these tests skip, and the reliability suite goes through Serve's own proxy, unless
REQUIRE_NGINX=1 (set by .ci/run, which installs the Debian package), when they fail.
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack

import pytest

from service.front.supervisor import nginx_binary
from service.testing.cluster import fronted

log = logging.getLogger(__name__)
MISSING = "no nginx binary: install the Debian package `nginx` (apt-get install nginx)"


def required() -> bool:
    return os.environ.get("REQUIRE_NGINX") == "1"


def nginx_or_skip() -> str:
    binary = nginx_binary()
    if binary is None:
        if required():
            pytest.fail(f"{MISSING}; REQUIRE_NGINX=1 makes this a failure")
        pytest.skip(MISSING)
    return binary


def nginx_if_present() -> str | None:
    """The binary; None (Serve's proxy is the front then, as `python -m service` does) without it."""
    binary = nginx_binary()
    if binary is None:
        if required():
            pytest.fail(f"{MISSING}; REQUIRE_NGINX=1 makes this a failure")
        log.warning("%s: the end-to-end tests go through Serve's own proxy", MISSING)
    return binary


def client_url(stack: ExitStack, serve_url: str, max_body_bytes: int, retry_after_s: int,
               metrics_dir: str | None = None) -> str:
    """Where the end-to-end tests' clients go: the nginx front (entered on `stack`) before the Serve at
    `serve_url`, as `python -m service` runs it, or that Serve's own proxy without nginx."""
    nginx = nginx_if_present()
    if nginx is None:
        return serve_url
    return stack.enter_context(fronted(serve_url, nginx, max_body_bytes, retry_after_s,
                                       metrics_dir=metrics_dir)).url
