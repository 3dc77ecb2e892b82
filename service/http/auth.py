"""Access control of the HTTP API: optional API keys (`Authorization: Bearer <key>`) and CORS (off
unless `cors_origins` names origins).

Keys come from `api_keys` (e.g. `TS_API_KEYS=key1,key2`), the file `api_keys_file` (one a line,
blank lines and `#` comments skipped) and the `tenants` (each a group of keys with its quotas:
service/http/quotas.py), read once when the ingress builds its app; none configured: no check. A
request's tenant (None for the plain keys) goes in the ASGI scope's state (`tenant`) for the quotas.
A key file with no key fails start-up (fail closed). Always public: /healthz, /readyz; /metrics only
with `protect_metrics: false`; /docs, /redoc, /openapi.json unless `protect_docs`. Every other
path, unknown ones included, needs a key. The check compares the token's hash with every key's by
`hmac.compare_digest`, never stopping at a match (constant time); every refusal is the same 401
`unauthorized` with `WWW-Authenticate: Bearer`, whatever was wrong.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..settings import Settings

ALWAYS_PUBLIC = frozenset({"/healthz", "/readyz"})
METRICS_PATHS = frozenset({"/metrics"})
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
UNAUTHORIZED = {"error": {"type": "unauthorized",
                          "message": "missing or invalid API key; send `Authorization: Bearer <key>`"}}
CHALLENGE = {"WWW-Authenticate": "Bearer"}
SCHEME = "bearerAuth"  # the security scheme's name in /openapi.json


def load_keys(settings: Settings) -> tuple[str, ...]:
    """The configured keys: `api_keys` then the lines of `api_keys_file`, then the tenants'. Raises
    ValueError when the file is missing, unreadable or names no key, or a key is in two tenants."""
    keys = [k.get_secret_value() for k in settings.api_keys]
    if settings.api_keys_file is not None:
        path = Path(settings.api_keys_file).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ValueError(f"api_keys_file {str(path)!r} cannot be read: {e.strerror}") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise ValueError(f"api_keys_file {str(path)!r} holds no key (one key per line)")
        keys += from_file
    owned = key_tenants(settings)
    keys += [k for k in owned if k not in keys]
    for key in keys:
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key is empty or contains whitespace")
    return tuple(keys)


def key_tenants(settings: Settings) -> dict[str, str]:
    """key -> the tenant it belongs to. ValueError when a key is in two tenants."""
    owner: dict[str, str] = {}
    for name, tenant in settings.tenants.items():
        for secret in tenant.keys:
            key = secret.get_secret_value()
            if owner.setdefault(key, name) != name:
                raise ValueError(f"an API key is in two tenants: {owner[key]!r} and {name!r}")
    return owner


def public_paths(settings: Settings) -> frozenset[str]:
    """The paths served without a key (compared without a trailing slash)."""
    return (ALWAYS_PUBLIC | (frozenset() if settings.protect_metrics else METRICS_PATHS)
            | (frozenset() if settings.protect_docs else DOCS_PATHS))


class KeyChecker:
    """Constant-time membership of a presented token among the keys (SHA-256 digests compared), and
    the tenant of the key it matched (`owners`: key -> tenant)."""

    def __init__(self, keys: Iterable[str], owners: dict[str, str] | None = None) -> None:
        keys = list(keys)
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self._owners = [(owners or {}).get(k) for k in keys]
        if not self._digests:
            raise ValueError("KeyChecker needs at least one key")

    def match(self, token: bytes) -> tuple[bool, str | None]:
        """(whether the token is a key, that key's tenant or None)."""
        presented = hashlib.sha256(token).digest()
        found, tenant = False, None
        for digest, owner in zip(self._digests, self._owners, strict=True):  # no early exit: every key is compared
            same = hmac.compare_digest(presented, digest)
            found |= same
            tenant = owner if same else tenant
        return found, tenant

    def __call__(self, token: bytes) -> bool:
        return self.match(token)[0]


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the one `Authorization: Bearer <token>` header; None when absent, repeated or
    of another scheme (the scheme name is case-insensitive, RFC 6750)."""
    values = [v for k, v in headers if k.lower() == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def route_path(scope: Scope) -> str:
    """The path within the app (Serve mounts it under a route prefix, given as root_path)."""
    path, root = scope.get("path", "/"), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path.rstrip("/") or "/"


class ApiKeyAuth:
    """ASGI middleware: 401 for any HTTP request off the public paths without a valid key, before
    the body is read. CORS preflights (which carry no credentials) never get here: the CORS
    middleware, outside this one, answers them."""

    def __init__(self, app: ASGIApp, check: KeyChecker, public: frozenset[str]) -> None:
        self.app, self.check, self.public = app, check, public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in self.public:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        found, tenant = self.check.match(token) if token is not None else (False, None)
        if not found:
            await JSONResponse(UNAUTHORIZED, status_code=401, headers=CHALLENGE)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def install_auth(app: FastAPI, settings: Settings, error_model: Any) -> bool:
    """Add the key check to `app` when keys are configured (and document it in /openapi.json: a
    bearer security scheme and a 401 on every protected operation). Returns whether it did.
    Raises ValueError for a bad key file. Add it after the body limit, so it runs first."""
    keys = load_keys(settings)
    if not keys:
        return False
    public = public_paths(settings)
    app.add_middleware(ApiKeyAuth, check=KeyChecker(keys, key_tenants(settings)), public=public)
    build_schema = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build_schema()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})[SCHEME] = {
            "type": "http", "scheme": "bearer", "description": "An API key of this server."}
        ref = {"$ref": f"#/components/schemas/{error_model.__name__}"}
        for path, operations in schema.get("paths", {}).items():
            if path.rstrip("/") in public:
                continue
            for operation in operations.values():
                operation["security"] = [{SCHEME: []}]
                operation.setdefault("responses", {})["401"] = {
                    "description": "Missing or invalid API key",
                    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
                    "content": {"application/json": {"schema": ref}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return True


def install_access_control(app: FastAPI, settings: Settings, error_model: Any, extra_headers: tuple[str, ...] = ()
                           ) -> None:
    """Keys (install_auth), then CORS outside them when `cors_origins` is set: preflights carry no
    credentials, and a browser must be able to read a 401. Call it after adding the body limit."""
    install_auth(app, settings, error_model)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_credentials=False,
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", *extra_headers], max_age=600)
