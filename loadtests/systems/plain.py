"""The plain alternative: FastAPI + uvicorn running transformers models per request, no batching.

    python -m loadtests.systems.plain --port 8101 --tasks classify,translate,generate [--models default]

Each request runs alone (a batch of its own inputs) in one inference thread, so requests queue
one behind the other (first come, first served) instead of interleaving their forward passes on
the same cores. A request whose client has gone by its turn is skipped, so requests abandoned at the
end of a benchmark run do not delay the next one. Models and settings come from the command line;
nothing is loaded at import time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Request

from .hf_models import Built, Counters
from .schemas import ClassifyIn, CompletionIn, TranslateIn, as_list, completion_response

log = logging.getLogger("loadtests.plain")
T = TypeVar("T")


def create_app(built: dict[str, Built]) -> FastAPI:
    app = FastAPI(title="plain transformers baseline")
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
    counters = {task: Counters() for task in built}
    turn = asyncio.Lock()  # first come, first served

    def model(task: str) -> Any:
        if task not in built:
            raise HTTPException(404, f"no model serves {task!r} here")
        return built[task].model

    async def run(task: str, n_items: int, fn: Callable[[], tuple[T, Any]], request: Request) -> T:
        async with turn:
            if await request.is_disconnected():
                raise HTTPException(499, "the client went away")  # nobody reads this answer
            try:
                out, cost = await asyncio.get_running_loop().run_in_executor(executor, fn)
            except ValueError as e:  # an input over a limit
                counters[task].failed += n_items
                raise HTTPException(422, str(e)) from None
        counters[task].add(n_items, cost)
        return out

    @app.post("/v1/classify")
    async def classify(body: ClassifyIn, request: Request) -> dict[str, Any]:
        m, texts = model("classify"), as_list(body.inputs)
        results = await run("classify", len(texts), lambda: m(texts), request)
        return {"model": built["classify"].info["name"], "results": results}

    @app.post("/v1/translate")
    async def translate(body: TranslateIn, request: Request) -> dict[str, Any]:
        m, texts = model("translate"), as_list(body.inputs)
        defaults = built["translate"].info["defaults"]
        beam = body.beam_size or defaults.get("beam_size", 4)
        max_new = body.max_new_tokens or defaults.get("max_new_tokens", 128)
        out = await run("translate", len(texts), lambda: m(texts, beam, max_new), request)
        return {"model": built["translate"].info["name"], "translations": out}

    @app.post("/v1/completions")
    async def completions(body: CompletionIn, request: Request) -> dict[str, Any]:
        m = model("generate")
        out = await run(
            "generate",
            1,
            lambda: m([body.prompt], [body.max_tokens], body.ignore_eos, body.temperature),
            request,
        )
        g = out[0]
        return completion_response(
            built["generate"].info["name"], g.text, g.prompt_tokens, g.completion_tokens, g.finish_reason
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": b.info["name"], "tasks": [task], "stats": counters[task].as_dict(), "info": b.info}
                for task, b in built.items()
            ],
            "tasks": {task: [b.info["name"]] for task, b in built.items()},
        }

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}  # the models are loaded before the server starts

    return app


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.systems.plain",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--tasks", default="classify,translate,generate")
    p.add_argument("--models", default="default", help="model set (loadtests/systems/modelsets.py)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16 | float16")
    p.add_argument("--cache-dir", type=Path, help="pinned weights (default: models.zoo.default_cache_dir())")
    return p.parse_args(argv)


def load(args: argparse.Namespace) -> dict[str, Built]:
    import torch

    from models.zoo import default_cache_dir

    from .hf_models import build_all
    from .modelsets import model_set

    torch.set_num_threads(args.threads)
    specs = model_set(args.models)
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    built = build_all(specs, [t for t in args.tasks.split(",") if t], cache_dir, args.device, args.dtype)
    for task, b in built.items():
        b.info["defaults"] = dict(specs[task].defaults)
    return built


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("plain baseline: pid %d, loading %s", os.getpid(), args.tasks)
    app = create_app(load(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=60)


if __name__ == "__main__":
    main()
