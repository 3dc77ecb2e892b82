"""API keys and CORS (service/auth.py) on the real app over an in-process fake backend (no Ray)."""

from __future__ import annotations

import asyncio
import hmac
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.http.api import create_api
from service.http.auth import UNAUTHORIZED, KeyChecker, route_path
from service.settings import Settings
from service.testing.fake_backend import EchoBackend, fake_app, fake_settings
from tests.service.http_checks import send

KEYS = ("key-one-0123456789", "key-two-abcdefghij")
CLASSIFY = ("POST", "/v1/classify", {"json": {"inputs": "hello"}})


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_unauthorized(r: httpx.Response) -> None:
    assert r.status_code == 401 and r.json() == UNAUTHORIZED
    assert r.headers["WWW-Authenticate"] == "Bearer"


def test_without_keys_every_route_is_open_and_the_schema_has_no_security() -> None:
    app = fake_app()
    method, path, kwargs = CLASSIFY
    assert send(app, method, path, **kwargs).status_code == 200
    assert send(app, "GET", "/v1/models").status_code == 200
    spec = send(app, "GET", "/openapi.json").json()
    assert "securitySchemes" not in spec.get("components", {})
    assert all("401" not in op["responses"] for ops in spec["paths"].values() for op in ops.values())


@pytest.mark.parametrize("source", ["settings", "env", "file"])
def test_each_configured_key_opens_the_api(source: str, tmp_path: Path) -> None:
    extra: dict[str, Any] = {}
    env: dict[str, str] = {}
    if source == "settings":
        extra = {"api_keys": list(KEYS)}
    elif source == "env":
        env = {"TS_API_KEYS": ",".join(KEYS)}
    else:
        path = tmp_path / "keys.txt"
        path.write_text(f"# our clients\n{KEYS[0]}\n\n  {KEYS[1]}  \n")
        extra = {"api_keys_file": str(path)}
    settings = Settings.build({**fake_settings().model_dump(include={"deployments", "max_inputs"}), **extra}, env)
    backend = EchoBackend()
    app = create_api(settings, backend)
    method, path, kwargs = CLASSIFY
    for key in KEYS:
        assert send(app, method, path, headers=bearer(key), **kwargs).status_code == 200
    assert_unauthorized(send(app, method, path, **kwargs))
    assert backend.calls == {"classify": 2}
    assert "key-one" not in repr(settings)  # keys are secrets: never in logs of the settings


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": f"Bearer {KEYS[0]}x"},
    {"Authorization": f"Bearer {KEYS[0][:-1]}"},
    {"Authorization": "Bearer "},
    {"Authorization": "Bearer"},
    {"Authorization": f"Basic {KEYS[0]}"},
    {"Authorization": KEYS[0]},
    {"Authorization": f"Bearer {KEYS[0].upper()}"},
    {"X-Api-Key": KEYS[0]},
], ids=["none", "longer", "prefix", "empty", "no-token", "basic", "no-scheme", "case", "other-header"])
def test_every_refusal_is_the_same_401(headers: dict[str, str]) -> None:
    backend = EchoBackend()
    app = fake_app({"api_keys": list(KEYS)}, backend)
    for method, path, kwargs in (CLASSIFY, ("GET", "/v1/models", {}), ("GET", "/no/such/route", {}),
                                 ("POST", "/v1/generate", {"json": {"prompt": "hi", "stream": True}})):
        assert_unauthorized(send(app, method, path, headers=headers, **kwargs))
    assert backend.calls == {}  # refused before any model call (and before the body is read)


def test_two_authorization_headers_are_refused() -> None:
    app = fake_app({"api_keys": list(KEYS)})
    method, path, kwargs = CLASSIFY
    headers = [("Authorization", f"Bearer {KEYS[0]}"), ("Authorization", f"Bearer {KEYS[1]}")]
    assert_unauthorized(send(app, method, path, headers=headers, **kwargs))
    assert send(app, method, path, headers={"authorization": f"bearer {KEYS[1]}"}, **kwargs).status_code == 200


@pytest.mark.parametrize(("extra", "open_paths", "closed_paths"), [
    ({}, ["/healthz", "/readyz", "/docs", "/redoc", "/openapi.json"], ["/metrics", "/metrics/"]),
    ({"protect_metrics": False}, ["/healthz", "/readyz", "/docs", "/metrics"], []),
    ({"protect_docs": True}, ["/healthz", "/readyz"], ["/docs", "/redoc", "/openapi.json", "/metrics"]),
])
def test_public_paths(extra: dict[str, Any], open_paths: list[str], closed_paths: list[str]) -> None:
    app = fake_app({"api_keys": list(KEYS), **extra})
    for path in open_paths:
        r = send(app, "GET", path)
        assert r.status_code == 200, (path, r.status_code)
    for path in closed_paths:
        assert_unauthorized(send(app, "GET", path))


def test_the_schema_documents_the_bearer_scheme_on_protected_routes() -> None:
    spec = send(fake_app({"api_keys": list(KEYS)}), "GET", "/openapi.json").json()
    assert spec["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "description": "An API key of this server."}
    for path, operations in spec["paths"].items():
        for op in operations.values():
            protected = path not in ("/healthz", "/readyz")
            assert ("401" in op["responses"]) == protected and ("security" in op) == protected, path


def test_the_key_check_compares_every_key_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(len(a))
        return real(a, b)

    monkeypatch.setattr("service.http.auth.hmac.compare_digest", counting)
    check = KeyChecker(["a", "bb", "ccc"])
    results = [check(token) for token in (b"a", b"ccc", b"nope", b"x" * 1000)]
    assert results == [True, True, False, False]
    assert compared == [32] * 12  # 3 keys x 4 tokens, always equal-length digests


def test_bad_key_files_stop_the_start_up(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        fake_app({"api_keys_file": str(empty)})
    with pytest.raises(ValueError, match="cannot be read"):
        fake_app({"api_keys_file": str(tmp_path / "missing.txt")})


def test_settings_read_keys_and_origins_as_lists() -> None:
    settings = Settings.build(fake_settings().model_dump(include={"deployments"}),
                              {"TS_API_KEYS": " a1 , b2,", "TS_CORS_ORIGINS": "https://a.example,https://b.example"})
    assert [k.get_secret_value() for k in settings.api_keys] == ["a1", "b2"]
    assert settings.cors_origins == ("https://a.example", "https://b.example")
    numeric = Settings.build(fake_settings().model_dump(include={"deployments"}), {"TS_API_KEYS": "12345"})
    assert [k.get_secret_value() for k in numeric.api_keys] == ["12345"]


def test_the_route_prefix_of_serve_is_not_part_of_the_path() -> None:
    assert route_path({"path": "/smollm2/healthz", "root_path": "/smollm2"}) == "/healthz"
    assert route_path({"path": "/metrics/", "root_path": ""}) == "/metrics"


def test_the_openai_client_sends_its_key_as_bearer() -> None:
    app = fake_app({"api_keys": list(KEYS)})

    async def main(key: str) -> str:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        async with openai.AsyncOpenAI(api_key=key, base_url="http://test/v1", http_client=http, max_retries=0) as c:
            done = await c.completions.create(model="gen", prompt="hello", max_tokens=3)
            return done.choices[0].text

    assert asyncio.run(main(KEYS[1])) == "okokok"
    with pytest.raises(openai.AuthenticationError) as refused:
        asyncio.run(main("not-a-key"))
    assert refused.value.status_code == 401 and refused.value.body == UNAUTHORIZED["error"]


PREFLIGHT = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_is_off_unless_configured() -> None:
    app = fake_app({"api_keys": list(KEYS)})
    r = send(app, "OPTIONS", "/v1/classify", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers
    method, path, kwargs = CLASSIFY
    r = send(app, method, path, headers={"Origin": "https://ui.example", **bearer(KEYS[0])}, **kwargs)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_configured_origins_get_cors_headers_and_preflights_need_no_key() -> None:
    app = fake_app({"api_keys": list(KEYS), "cors_origins": ["https://ui.example"]})
    r = send(app, "OPTIONS", "/v1/classify", headers=PREFLIGHT)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    method, path, kwargs = CLASSIFY
    refused = send(app, method, path, headers={"Origin": "https://ui.example"}, **kwargs)
    assert_unauthorized(refused)  # and the browser may read why
    assert refused.headers["access-control-allow-origin"] == "https://ui.example"
    other = send(app, "OPTIONS", "/v1/classify", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
