"""Our HTTP layer's own CPU per request: `python -m loadtests.experiments.asgi_cost [--n 3000]`.

Calls the real API (service/http/, over service/testing/fake_backend.py's near-free EchoBackend) as an
ASGI app in this process, without a server or a client, and a bare FastAPI route with one pydantic
model beside it, alternating; prints microseconds per `POST /v1/classify` for each. What is left of
a request's cost beyond this is the HTTP server, Ray Serve's proxy and handle hops (loadtests/experiments/hops.py)
and the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from service.testing.fake_backend import fake_app

BODY = {"inputs": "hello"}


async def call(app: Any, path: str, body: dict[str, Any]) -> int:
    """One request through the ASGI app; its status."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # no disconnect during the request
        return {}

    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(scope, receive, send)
    return statuses[0]


class PlainRequest(BaseModel):
    inputs: str | list[str]


def plain_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/classify")
    async def classify(body: PlainRequest) -> dict[str, Any]:
        return {"model": "m", "results": [{"label": "positive", "score": 0.75}]}

    return app


async def per_request_us(app: Any, n: int) -> float:
    for _ in range(200):
        assert await call(app, "/v1/classify", BODY) == 200
    started = time.perf_counter()
    for _ in range(n):
        await call(app, "/v1/classify", BODY)
    return (time.perf_counter() - started) / n * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.experiments.asgi_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    apps = {"ours": fake_app(), "plain FastAPI": plain_app()}
    times: dict[str, list[float]] = {name: [] for name in apps}
    for _ in range(args.rounds):  # alternating, so a noisy moment hits both
        for name, app in apps.items():
            times[name].append(asyncio.run(per_request_us(app, args.n)))
    for name, values in times.items():
        print(f"{name:>14}: {sorted(values)[len(values) // 2]:.0f} us per POST /v1/classify (median of {args.rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
