"""Headers Ray Serve's HTTP servers would act on themselves (service/http/proxy_headers.py), live over
HTTP: a client can neither shorten or switch off Serve's timeout nor its disconnect handling, and a
request id comes back once, valid. Through the front (nginx, when installed) and through Serve's own
proxy behind it."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from service.http.proxy_headers import ProxyHeaders, safe_headers
from service.telemetry.logs import valid_request_id
from tests.reliability.conftest import Live, engine_idle
from tests.service.http_checks import send as send_to

pytestmark = pytest.mark.e2e
LONG = {"prompt": "go on", "max_new_tokens": 400, "ignore_eos": True, "stream": True}
PATHS = pytest.mark.parametrize("via_serve", [False, True], ids=["front", "serve-proxy"])


def test_safe_headers_keep_one_valid_id_and_drop_serves_own() -> None:
    raw = [(b"X-Request-ID", b"not valid!"), (b"x-request-id", b"ok-2"), (b"x-request-timeout-seconds", b"0"),
           (b"X-Request-Disconnect-Disabled", b"?1"), (b"content-type", b"application/json")]
    out = safe_headers(raw)
    assert out == [(b"content-type", b"application/json"), (b"x-request-id", b"ok-2")]
    fresh = safe_headers([(b"x-request-id", b"<script>")])
    assert len(fresh) == 1 and fresh[0][1] != b"<script>" and valid_request_id(fresh[0][1].decode())


@PATHS
def test_a_client_cannot_switch_off_disconnect_handling(live: Live, via_serve: bool) -> None:
    before = live.wait_stats("generator", engine_idle)
    with live.client(via_serve=via_serve) as c, c.stream("POST", "/v1/generate", json=LONG,
                                      headers={"x-request-disconnect-disabled": "?1"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first event, then hang up
    after = live.wait_stats("generator", lambda s: engine_idle(s) and s["finished"].get("cancelled", 0)
                            > before["finished"].get("cancelled", 0), timeout_s=10)
    assert after["generated_tokens"] - before["generated_tokens"] < LONG["max_new_tokens"], after


@PATHS
def test_a_client_cannot_set_serves_timeout(live: Live, via_serve: bool) -> None:
    """`x-request-timeout-seconds` would replace Serve's timeout (and <= 0 turn it off): here it is
    ignored, so a request that takes longer than it asks for still gets its answer."""
    with live.client(via_serve=via_serve) as c:
        started = time.monotonic()
        r = c.post("/v1/generate", json={**LONG, "stream": False, "max_new_tokens": 200},
                   headers={"x-request-timeout-seconds": "0.05"})
        assert r.status_code == 200 and time.monotonic() - started > 0.05, r.text


@PATHS
@pytest.mark.parametrize("sent", ["bad id with spaces", "<script>", "x" * 200, "ok-id.1"])
def test_the_request_id_comes_back_once_and_valid(live: Live, sent: str, via_serve: bool) -> None:
    with live.client(via_serve=via_serve) as c:
        r = c.get("/healthz", headers={"X-Request-ID": sent})
        ids = r.headers.get_list("x-request-id")
        assert r.status_code == 200 and len(ids) == 1, ids
        assert valid_request_id(ids[0]) == ids[0]
        assert (ids[0] == sent) == (valid_request_id(sent) is not None)
        e = c.post("/v1/classify", json={}, headers={"X-Request-ID": sent})
        assert e.status_code == 422 and len(e.headers.get_list("x-request-id")) == 1


def proxied(status: int, content_type: bytes, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
            ) -> httpx.Response:
    """A request through ProxyHeaders in front of an app that answers as given (as Serve's proxy would)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type), *(headers or [])]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return send_to(ProxyHeaders(app), "GET", "/v1/anything", headers={"X-Request-ID": "rid-9"})


def test_serves_own_plain_text_errors_get_our_json_shape_without_internals() -> None:
    died = proxied(500, b"text/plain; charset=utf-8", b"ray.exceptions.ActorDiedError: The actor died ... secrets")
    assert died.status_code == 503 and died.json()["error"]["type"] == "model_not_ready"
    assert "ActorDied" not in died.text and died.headers["retry-after"] == "1"
    assert died.headers.get_list("x-request-id") == ["rid-9"]
    busy = proxied(503, b"text/plain", b"Request dropped due to backpressure", [(b"retry-after", b"1")])
    assert busy.status_code == 503 and busy.json()["error"]["type"] == "overloaded_error"
    late = proxied(408, b"text/plain", b"Request rid-9 timed out after 30s.")
    assert late.status_code == 504 and late.json()["error"]["type"] == "timeout_error"
    ours = proxied(500, b"application/json", b'{"error": {"type": "internal_error", "message": "m"}}')
    assert ours.status_code == 500 and ours.json()["error"]["type"] == "internal_error"  # our app's own: untouched
    metrics = proxied(200, b"text/plain; version=0.0.4", b"# TYPE x counter\n")
    assert metrics.status_code == 200 and metrics.text.startswith("# TYPE")


def test_a_proxy_that_fails_before_answering_gives_our_503() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("ray.exceptions.ActorDiedError: the ingress replica died (internals)")

    r = send_to(ProxyHeaders(app), "GET", "/v1/anything", headers={"X-Request-ID": "rid-10"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "model_not_ready" and "internals" not in r.text
    assert r.headers["retry-after"] == "1" and r.headers.get_list("x-request-id") == ["rid-10"]


def test_a_proxy_that_answers_nothing_gives_our_503() -> None:
    """Serve's proxy sends no response when the ingress replica died (Ray 2.60: only 408/429/503 get one),
    and the HTTP server would answer a bare 500."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    r = send_to(ProxyHeaders(app), "POST", "/v1/classify", json={"inputs": "a"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "model_not_ready"
