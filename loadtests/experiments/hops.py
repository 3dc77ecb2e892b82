"""Measure what each hop of a request costs: `python -m loadtests.experiments.hops [--n 300]`.

Starts a local Ray + Serve with tiny models (max_wait 0, so no batching wait) and times, for a
trivial request, sequentially (one request in flight, so these are latencies, not throughput):

  http      a plain uvicorn + FastAPI app answering GET /ping in this process (HTTP client + server)
  proxy     GET /healthz through Serve: HAProxy (or Serve's proxy) -> ingress replica, on the request
            path `python -m service` chooses (service/ray_env.py)
  handle    DeploymentHandle call from this process to the encoder replica's info(): one Ray hop
  models    GET /v1/models: proxy -> ingress -> encoder replica's info() (the hops, no batching)
  classify  POST /v1/classify with one 1-character text: proxy -> ingress -> encoder replica
  compute   the same batch run directly on the tiny model (no HTTP, no Ray)
  in-process  POST /v1/classify on the FastAPI app in this process, calling the model runner directly

The proxy hop costs `proxy - http`; the ingress -> model hop `models - proxy` (compare `handle`,
the same hop from a plain process); `classify - models` is validation, tokenization, the batcher,
its inference thread and the model (compare `in-process`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("loadtests.experiments.hops")
TINY_ARGS: dict[str, Any] = {
    "device": "cpu",
    "deployments": {
        "encoder": {"model": {"name": "tiny-encoder", "tasks": ["classify", "embed"], "source": "tiny:encoder"},
                    "num_cpus": 0, "batching": {"max_wait_ms": 0}},
    },
}


def _time(fn: Callable[[], Any], n: int) -> dict[str, float]:
    for _ in range(min(20, n)):  # warm-up
        fn()
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return {"p50_ms": statistics.median(samples), "p90_ms": samples[int(0.9 * (len(samples) - 1))],
            "mean_ms": statistics.fmean(samples)}


def _plain_http(port: int) -> threading.Thread:
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"status": "ok"}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return thread


def measure(n: int, worker_env: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    import httpx
    import torch
    from ray import serve

    from models.catalog import ModelSpec, load_model
    from service.replica.config import BatchLimits
    from service.replica.encoder import EncodeItem, EncoderRunner
    from service.replica.tokenize import tokenize
    from service.testing.cluster import deploy, free_port, local_cluster

    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    plain_port = free_port()
    _plain_http(plain_port)
    with httpx.Client(base_url=f"http://127.0.0.1:{plain_port}") as c:
        results["http"] = _time(lambda: c.get("/ping").raise_for_status(), n)

    with local_cluster(num_cpus=4, env=worker_env) as url:
        deploy(TINY_ARGS, name="hops")
        with httpx.Client(base_url=url) as c:
            results["proxy"] = _time(lambda: c.get("/healthz").raise_for_status(), n)
            handle = serve.get_deployment_handle("encoder", app_name="hops")
            loop = asyncio.new_event_loop()  # throughput mode runs a handle's router on the caller's loop

            async def info() -> Any:
                return await handle.info.remote()

            results["handle"] = _time(lambda: loop.run_until_complete(info()), n)
            results["models"] = _time(lambda: c.get("/v1/models").raise_for_status(), n)
            results["classify"] = _time(lambda: c.post("/v1/classify", json={"inputs": "a"}).raise_for_status(), n)

    spec = ModelSpec(name="tiny", tasks=("classify",), source="tiny:encoder")
    runner = EncoderRunner(load_model(spec, Path("/nonexistent")), "encoder", BatchLimits(max_wait_ms=0))
    ids = tokenize(runner.loaded.tokenizer, ["a"], 64, truncate=False)
    results["compute"] = _time(lambda: runner.run_batch([EncodeItem(ids[0], "classify")]), n)
    results["in-process"] = _in_process(runner, n)
    return results


def _in_process(runner: Any, n: int) -> dict[str, float]:
    """POST /v1/classify on the FastAPI app in this process, its backend calling the runner directly:
    validation + tokenization + batcher + inference thread, without HTTP or Ray."""
    import httpx

    from service.http.api import create_api
    from service.settings import Settings

    class Direct:
        async def call(self, deployment: str, method: str, *args: Any) -> Any:
            return await getattr(runner, method)(*args)

        async def info(self, deployment: str, timeout_s: float) -> Any:
            return runner.info()

    app = create_api(Settings.build(TINY_ARGS, env={}), Direct())

    async def run() -> dict[str, float]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hops") as c:
            samples = []
            for i in range(n + 20):
                started = time.perf_counter()
                (await c.post("/v1/classify", json={"inputs": "a"})).raise_for_status()
                if i >= 20:
                    samples.append((time.perf_counter() - started) * 1000)
        runner.close()
        samples.sort()
        return {"p50_ms": statistics.median(samples), "p90_ms": samples[int(0.9 * (n - 1))],
                "mean_ms": statistics.fmean(samples)}

    return asyncio.run(run())


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtests.experiments.hops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=300, help="requests per measurement")
    p.add_argument("--worker-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the Ray workers, e.g. RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from service.ray_env import use_fast_path

    log.info("Ray Serve request path: %s", use_fast_path(os.environ))  # as `python -m service` runs
    results = measure(args.n, dict(kv.split("=", 1) for kv in args.worker_env))
    log.info("%-9s %8s %8s %8s", "hop", "p50 ms", "p90 ms", "mean ms")
    for name, r in results.items():
        log.info("%-9s %8.2f %8.2f %8.2f", name, r["p50_ms"], r["p90_ms"], r["mean_ms"])


if __name__ == "__main__":
    main()
