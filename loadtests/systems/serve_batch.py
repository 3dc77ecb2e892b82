"""The Ray Serve documentation's way: one deployment with a FastAPI ingress and `@serve.batch`.

    python -m loadtests.systems.serve_batch --port 8102 --tasks classify,translate,generate

As in Ray Serve's batching guide: the route awaits a `@serve.batch` method with one item; Serve
gathers up to max_batch_size items (or waits batch_wait_timeout_s) and calls the method with the
list; the method runs the transformers model on the batch padded to the longest, synchronously on the
replica's event loop, and returns one result per item. Generation is static batching: one padded
generate() per batch, which runs until its longest request is done (no streaming). A local Ray is
started in this process and shut down on SIGTERM / Ctrl-C.

(No `from __future__ import annotations` here: Serve's class-based ingress hands FastAPI the route
methods without this module's namespace, so string annotations would not resolve and the bodies
would be read as query parameters.)
"""

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from ray import serve

from .hf_models import Counters, Generated
from .schemas import ClassifyIn, CompletionIn, TranslateIn, as_list, completion_response

log = logging.getLogger("loadtests.serve_batch")
ROOT = Path(__file__).resolve().parents[2]
MAX_BATCH_SIZE = 32  # the guide's defaults for this benchmark; --max-batch-size / --batch-wait-ms change them
BATCH_WAIT_S = 0.005

app = FastAPI(title="Ray Serve @serve.batch baseline")


@serve.deployment
@serve.ingress(app)
class BatchedModels:
    def __init__(self, options: dict[str, Any]) -> None:
        from .plain import load

        self.built = load(argparse.Namespace(**options))
        self.counters = {task: Counters() for task in self.built}
        for handler in (self.classify_batch, self.translate_batch, self.generate_batch):
            handler.set_max_batch_size(options["max_batch_size"])
            handler.set_batch_wait_timeout_s(options["batch_wait_ms"] / 1000.0)

    def _model(self, task: str) -> Any:
        if task not in self.built:
            raise HTTPException(404, f"no model serves {task!r} here")
        return self.built[task].model

    @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_S)
    async def classify_batch(self, texts: list[str]) -> list[dict[str, Any]]:
        out, cost = self.built["classify"].model(texts)
        self.counters["classify"].add(len(texts), cost)
        return out

    @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_S)
    async def translate_batch(self, items: list[tuple[str, int, int]]) -> list[str]:
        """items: (text, beam_size, max_new_tokens); one generate() per distinct (beam, length)."""
        out: list[str] = [""] * len(items)
        for key in dict.fromkeys((beam, n) for _, beam, n in items):
            rows = [i for i, it in enumerate(items) if it[1:] == key]
            texts, cost = self.built["translate"].model([items[i][0] for i in rows], *key)
            self.counters["translate"].add(len(rows), cost)
            for i, text in zip(rows, texts, strict=True):
                out[i] = text
        return out

    @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_S)
    async def generate_batch(self, items: list[tuple[str, int, bool, float]]) -> list[Generated]:
        """items (prompt, max_tokens, ignore_eos, temperature); a generate() per (ignore_eos, temperature)."""
        out: list[Any] = [None] * len(items)
        for key in dict.fromkeys(it[2:] for it in items):
            rows = [i for i, it in enumerate(items) if it[2:] == key]
            results, cost = self.built["generate"].model(
                [items[i][0] for i in rows], [items[i][1] for i in rows], *key
            )
            self.counters["generate"].add(len(rows), cost)
            for i, r in zip(rows, results, strict=True):
                out[i] = r
        return out

    @app.post("/v1/classify")
    async def classify(self, body: ClassifyIn) -> dict[str, Any]:
        self._model("classify")
        results = await asyncio.gather(*(self.classify_batch(t) for t in as_list(body.inputs)))
        return {"model": self.built["classify"].info["name"], "results": list(results)}

    @app.post("/v1/translate")
    async def translate(self, body: TranslateIn) -> dict[str, Any]:
        self._model("translate")
        defaults = self.built["translate"].info["defaults"]
        beam = body.beam_size or defaults.get("beam_size", 4)
        max_new = body.max_new_tokens or defaults.get("max_new_tokens", 128)
        out = await asyncio.gather(*(self.translate_batch((t, beam, max_new)) for t in as_list(body.inputs)))
        return {"model": self.built["translate"].info["name"], "translations": list(out)}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionIn) -> dict[str, Any]:
        try:
            self._model("generate").check(body.prompt, body.max_tokens)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        g = await self.generate_batch((body.prompt, body.max_tokens, body.ignore_eos, body.temperature))
        return completion_response(
            self.built["generate"].info["name"], g.text, g.prompt_tokens, g.completion_tokens, g.finish_reason
        )

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": b.info["name"],
                    "tasks": [task],
                    "info": b.info,
                    "stats": self.counters[task].as_dict(),
                }
                for task, b in self.built.items()
            ],
            "tasks": {task: [b.info["name"]] for task, b in self.built.items()},
        }

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(self) -> dict[str, str]:
        return {"status": "ready"}  # answered by the replica itself, so only once its models are loaded


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from .plain import parse as parse_plain

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--max-batch-size", type=int, default=MAX_BATCH_SIZE)
    p.add_argument("--batch-wait-ms", type=float, default=BATCH_WAIT_S * 1000)
    ours, rest = p.parse_known_args(argv)
    args = parse_plain(rest)
    args.max_batch_size, args.batch_wait_ms = ours.max_batch_size, ours.batch_wait_ms
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import ray

    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("host", "port")
    }
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",
        num_cpus=max(2, os.cpu_count() or 1),
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": str(args.threads)}},
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        deployment = BatchedModels.options(
            max_ongoing_requests=2 * args.max_batch_size, ray_actor_options={"num_cpus": 1}
        )
        serve.run(deployment.bind(options), name="serve-batch", route_prefix="/")
        log.info("serve_batch baseline on http://%s:%d", args.host, args.port)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log.info("stopping")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
