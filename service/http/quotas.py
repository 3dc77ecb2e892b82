"""Quotas per tenant (a group of API keys, `tenants` in the settings): requests per second and tokens
per minute, each a token bucket, checked at the ingress before the body is read, so a tenant over its
quota gets a 429 without touching a model replica.

- requests: a request takes one from the bucket (`requests_per_s`, up to `request_burst` at once);
  none left: 429, `Retry-After` the seconds until one is.
- tokens: a request is admitted while the tenant's token bucket (`tokens_per_min`, refilled each
  second by a sixtieth) is not in debt; what it used is charged when known (a generation's prompt and
  output tokens as each ends, streams included; an embedding request's input tokens), so one large
  request may take the bucket below zero and the next waits until it is refilled. Classification,
  reranking and translation count as requests only.

A tenant's generations run at its `priority` (lower is sooner: the engine admits them before, and
preempts them after, requests of a larger value), which is also the soonest a request may ask for;
its classifications, embeddings, rerankings and translations are queued at it too (batched, or
admitted by the translation engine, ahead of a larger value).
Tenants are also kept apart in the generators' prefix caches: a tenant's requests reuse only its own
cached prefixes (cache_salt; `share_prefix_cache: true` lets a tenant share the cache with the
requests of no tenant and of other sharing tenants).

Every answer to a limited tenant carries OpenAI's `x-ratelimit-limit-*`, `-remaining-*` and
`-reset-*` headers (requests, tokens). The buckets are this ingress replica's: each of the ingress's
`num_replicas` replicas holds the configured rates divided by that number. Refusals and charged tokens
are counted per tenant (never per key). The ASGI middleware runs after the key check (which puts the
request's tenant in the scope's state) and before the body limit.
"""

from __future__ import annotations

import contextvars
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import RateLimited
from ..settings import Settings, TenantSettings
from ..telemetry.metrics import ServiceMetrics

LIMITS = ("requests", "tokens")  # what refused a request: the `limit` label of quota_refused_total


@dataclass(frozen=True)
class Tenancy:
    """What the routes need of the request's tenant (set by Quotas for the request's context)."""

    tenant: str
    salt: str | None  # its prefix-cache salt (None: it shares the cache)
    priority: int  # its requests' priority: the default and the soonest a generation may ask for
    charge: Callable[[int], None]  # tokens used, for its bucket and counter


_CURRENT: contextvars.ContextVar[Tenancy | None] = contextvars.ContextVar("ts_tenancy", default=None)


def current_tenant() -> str | None:
    """The tenant of the request being answered (None: no tenant)."""
    t = _CURRENT.get()
    return None if t is None else t.tenant


def cache_salt(requested: str | None) -> str | None:
    """A generation's prefix-cache salt: its tenant's (unless the tenant shares the cache) and the
    request's own `cache_salt`; None: neither (the cache is shared with every such request)."""
    t = _CURRENT.get()
    parts = [p for p in (None if t is None else t.salt, requested) if p]
    return "\x1f".join(parts) or None


def allowed_priority(requested: int | None) -> int | None:
    """A generation's priority: what it asks for, never sooner than its tenant's (lower is sooner);
    the tenant's when it asks for none. No tenant: as asked."""
    t = _CURRENT.get()
    if t is None:
        return requested
    return t.priority if requested is None else max(requested, t.priority)


def tenant_priority() -> int:
    """The priority of the request's tenant (lower is sooner; no tenant: 0): encoders and translators
    batch and admit its inputs ahead of less urgent tenants'."""
    t = _CURRENT.get()
    return 0 if t is None else t.priority


def charge_tokens(tokens: int) -> None:
    """Charge `tokens` to the tenant of the request being answered (nothing without a tenant)."""
    t = _CURRENT.get()
    if t is not None and tokens > 0:
        t.charge(tokens)


@dataclass
class Bucket:
    """A token bucket: `capacity` at most, refilled at `rate` a second; its level may go below zero."""

    rate: float
    capacity: float
    level: float
    stamp: float

    @classmethod
    def full(cls, rate: float, capacity: float, now: float) -> Bucket:
        return cls(rate, capacity, capacity, now)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now

    def seconds_until(self, level: float) -> float:
        """Seconds until the bucket holds `level` (0 when it does)."""
        return max(0.0, (level - self.level) / self.rate)


def duration(seconds: float) -> str:
    """OpenAI's reset durations: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


class Ledger:
    """One tenant's buckets on this ingress replica (none without quotas; the event loop's: no locking)."""

    def __init__(self, tenant: TenantSettings, share: int, now: float) -> None:
        self.requests = self.tokens = None
        if tenant.requests_per_s is not None:
            rate = tenant.requests_per_s / share
            self.requests = Bucket.full(rate, float(tenant.request_burst or max(1.0, rate)), now)
        if tenant.tokens_per_min is not None:
            per_min = tenant.tokens_per_min / share
            self.tokens = Bucket.full(per_min / 60, per_min, now)

    def admit(self, now: float) -> tuple[str, float] | None:
        """Take a request: None, or (the limit that refuses it, seconds until it would not)."""
        if self.requests is not None:
            self.requests.refill(now)
            if self.requests.level < 1:
                return "requests", self.requests.seconds_until(1)
        if self.tokens is not None:
            self.tokens.refill(now)
            if self.tokens.level <= 0:
                return "tokens", max(self.tokens.seconds_until(1), 0.001)
        if self.requests is not None:
            self.requests.level -= 1
        return None

    def charge(self, tokens: int, now: float) -> None:
        if self.tokens is not None:
            self.tokens.refill(now)
            self.tokens.level -= tokens

    def headers(self, now: float) -> list[tuple[bytes, bytes]]:
        out = []
        for name, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is None:
                continue
            bucket.refill(now)
            out += [(f"x-ratelimit-limit-{name}".encode(), str(int(bucket.capacity)).encode()),
                    (f"x-ratelimit-remaining-{name}".encode(), str(max(0, math.floor(bucket.level))).encode()),
                    (f"x-ratelimit-reset-{name}".encode(), duration(bucket.seconds_until(bucket.capacity)).encode())]
        return out


class Quotas:
    """ASGI middleware: each tenant's request admitted by its buckets (a tenant without quotas: always)
    or answered 429, and its Tenancy set for the routes."""

    def __init__(self, app: ASGIApp, settings: Settings, metrics: ServiceMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app, self.clock, self.tenants = app, clock, settings.tenants
        share, now = settings.ingress.num_replicas, clock()
        self.ledgers = {name: Ledger(t, share, now) for name, t in settings.tenants.items()}
        self.refused = {(name, limit): metrics["quota_refused_total"].labels(name, limit)
                        for name in settings.tenants for limit in LIMITS}
        self.charged = {name: metrics["tenant_tokens_total"].labels(name) for name in settings.tenants}
        self.admitted = {name: metrics["tenant_requests_total"].labels(name) for name in settings.tenants}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = scope.get("state", {}).get("tenant") if scope["type"] == "http" else None
        if tenant is None:
            await self.app(scope, receive, send)
            return
        ledger, now = self.ledgers[tenant], self.clock()
        refusal = ledger.admit(now)
        if refusal is not None:
            limit, wait = refusal
            self.refused[tenant, limit].inc()
            await self._refuse(send, tenant, limit, wait, ledger.headers(now))
            return
        self.admitted[tenant].inc()

        def charge(tokens: int) -> None:
            ledger.charge(tokens, self.clock())
            self.charged[tenant].inc(tokens)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *ledger.headers(self.clock())]}
            await send(message)

        settings = self.tenants[tenant]
        token = _CURRENT.set(Tenancy(tenant, None if settings.share_prefix_cache else f"tenant:{tenant}",
                                     settings.priority, charge))
        try:
            await self.app(scope, receive, with_headers)
        finally:
            _CURRENT.reset(token)

    @staticmethod
    async def _refuse(send: Send, tenant: str, limit: str, wait: float, headers: list[tuple[bytes, bytes]]) -> None:
        what = "requests per second" if limit == "requests" else "tokens per minute"
        error = RateLimited(f"rate limit of tenant {tenant!r} reached: {what}; retry in {duration(wait)}")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": error.status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(max(1, math.ceil(wait))).encode()), *headers]})
        await send({"type": "http.response.body", "body": body})
