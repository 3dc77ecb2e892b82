"""Running the benchmark against one system: start it, wait until ready, every task at every load
level (closed loop, then Poisson for generation), batching counters before and after each run, a
settle wait when a run left requests behind, then stop it. Results go to a Recorder that rewrites
results.json after every run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import workload
from .loadgen import closed_loop, http_client, open_loop
from .plan import Plan, Workloads
from .protocol import RequestSpec, discover_generate
from .summary import stats_delta, stats_for_task, summarize

log = logging.getLogger("loadtests.bench")


class Recorder:
    """Collects results and rewrites results.json after each run."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.path = out / "results.json"
        self.results: dict[str, Any] = {"meta": meta, "systems": {}, "runs": []}

    def add_run(self, run: dict[str, Any]) -> None:
        self.results["runs"].append(run)
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.results, indent=1, default=str))


STATS_TIMEOUT_S = 5.0  # a server busy in a long synchronous batch (serve_batch) may not answer meanwhile


async def _models(client: Any) -> dict[str, Any] | None:
    """/v1/models, or None when the server does not answer it in time (stats are optional)."""
    try:
        r = await client.get("/v1/models", timeout=STATS_TIMEOUT_S)
        return r.json() if r.status_code == 200 else None
    except Exception:  # httpx errors, bad JSON: the run goes on without stats
        return None


def _task_stats(payload: dict[str, Any] | None, task: str) -> dict[str, float] | None:
    return None if payload is None else stats_for_task(payload, task)


async def _settle(client: Any, task: str, limit_s: float) -> tuple[float, bool]:
    """Wait until the server answers /v1/models and its counters for `task` stop moving (requests the
    last run abandoned are done or dropped). Returns (seconds waited, whether it settled in limit_s)."""
    started = time.monotonic()
    last = _task_stats(await _models(client), task)
    while time.monotonic() - started < limit_s:
        await asyncio.sleep(1.0)
        now = _task_stats(await _models(client), task)
        if now is not None and now == last:
            return time.monotonic() - started, True
        last = now
    return time.monotonic() - started, False


class Progress:
    def __init__(self, total_runs: int, estimate_s: float) -> None:
        self.total, self.done, self.started, self.estimate_s = total_runs, 0, time.monotonic(), estimate_s

    def next(self, label: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.started
        left = (
            max(self.estimate_s - elapsed, 0.0)
            if self.done <= 1
            else elapsed / (self.done - 1) * (self.total - self.done + 1)
        )
        log.info(
            "[%d/%d] %s (elapsed %s, about %s left)",
            self.done,
            self.total,
            label,
            _mmss(elapsed),
            _mmss(left),
        )


def _mmss(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


async def run_system(
    name: str, url: str, tasks: Sequence[str], plan: Plan, work: Workloads, rec: Recorder, progress: Progress,
    openapi: dict[str, Any] | None = None,
) -> None:
    info = rec.results["systems"][name]
    busy = False  # the previous run left work running past the settle limit
    connections = max(max(plan.concurrency, default=0), 256)  # a Poisson-only plan has no levels
    async with http_client(url, connections, plan.request_timeout_s) as client:
        cards = (await _models(client) or {}).get("data", [])
        info["models"] = [{k: v for k, v in card.items() if k != "stats"} for card in cards]
        for task in tasks:
            specs = await _task_specs(client, task, work, info, plan, rec.results["meta"], openapi)
            if specs is None:
                progress.done += len(plan.concurrency) + (
                    len(plan.poisson_rates) if task == "generate" else 0
                )
                continue
            loads: list[tuple[str, float]] = [("closed", c) for c in sorted(plan.concurrency)]
            if task == "generate":  # the open loop first, on an idle server (static batches of the
                loads = [("poisson", r) for r in plan.poisson_rates] + loads  # closed loop can outlast a run)
            for mode, level in loads:
                label = f"{name} {task} " + (
                    f"{int(level)} clients" if mode == "closed" else f"Poisson {level:g} req/s"
                )
                progress.next(label)
                before = _task_stats(await _models(client), task)
                if mode == "closed":
                    outcome = await closed_loop(
                        client, specs, int(level), plan.timing, label, plan.progress_s
                    )
                else:
                    horizon = plan.timing.window[1]
                    arrivals = workload.poisson_arrivals(level, horizon, random.Random(plan.seed + 1))
                    outcome = await open_loop(client, specs, arrivals, plan.timing, label, plan.progress_s)
                waited, idle = (
                    await _settle(client, task, plan.settle_s) if outcome.unfinished or busy else (0.0, True)
                )
                if not idle:
                    log.warning(
                        "  %s still busy %.0f s after the run; the next run may be slowed", name, waited
                    )
                after = _task_stats(await _models(client), task)
                run = {
                    "system": name,
                    "task": task,
                    "mode": mode,
                    "concurrency": int(level) if mode == "closed" else None,
                    "rate": level if mode == "poisson" else None,
                    "wall_s": outcome.wall_s,
                    "settle_s": waited,
                    "busy_before": busy,
                    "idle_after": idle,
                    **summarize(outcome, task == "generate"),
                    "server": stats_delta(before, after),
                }
                rec.add_run(run)
                _log_run(run)
                busy = not idle


async def _task_specs(
    client: Any, task: str, work: Workloads, info: dict[str, Any], plan: Plan, meta: dict[str, Any],
    openapi: dict[str, Any] | None = None,
) -> list[RequestSpec] | None:
    """`openapi`: the system's generation route when it publishes no OpenAPI document."""
    if task == "classify":
        return work.classify
    if task == "embed":
        return work.embed
    if task == "translate":
        return work.translate
    doc = openapi or {}
    try:
        if openapi is None:
            r = await client.get("/openapi.json", timeout=60.0)
            doc = r.json() if r.status_code == 200 else {}
    except Exception as e:  # reported below as the reason generation was not measured
        log.warning("generate: /openapi.json did not answer: %r", e)
    served = (await _models(client) or {}).get("tasks", {}).get("generate") or [None]
    api, note = discover_generate(doc, served[0])
    info["generate_api"] = note
    log.info("generate: %s", note)
    if api is None:
        info.setdefault("skipped", {})["generate"] = note
        return None
    if meta.get("exact_length") is None:  # decided once per benchmark, by the first system that generates
        meta["exact_length"] = {"on": True, "off": False}.get(plan.ignore_eos, api.exact_field is not None)
    exact = meta["exact_length"]
    if exact and api.exact_field is None:
        log.warning("generate: %s takes no exact output length; its outputs stop at EOS", api.path)
    info["exact_length"] = exact and api.exact_field is not None
    return [api.request(it.prompt, it.max_tokens, stream=True, exact=exact) for it in work.generate]


def _log_run(run: dict[str, Any]) -> None:
    lat = run["latency_ms"]
    extra = f", {run['output_tokens_per_s']:.1f} tok/s" if "output_tokens_per_s" in run else ""
    server = run.get("server") or {}
    batch = f", mean batch {server['mean_batch_size']:.1f}" if "mean_batch_size" in server else ""
    p50, p95 = lat["p50"], lat["p95"]
    log.info(
        "  -> %.2f req/s%s, p50 %s ms, p95 %s ms, %d errors, %d unfinished%s",
        run["throughput_rps"],
        extra,
        f"{p50:.1f}" if p50 is not None else "-",
        f"{p95:.1f}" if p95 is not None else "-",
        run["errors"],
        run["unfinished"],
        batch,
    )
    if run["errors"]:
        log.warning("  errors %s, e.g. %s", run["error_kinds"], run["error_samples"][:1])


def bench_system(
    name: str,
    plan: Plan,
    work: Workloads,
    rec: Recorder,
    progress: Progress,
    out: Path,
    cache_dir: str | None,
) -> None:
    from .systems.launchers import SYSTEMS, LaunchConfig
    from .systems.process import ServerProcess, StartError, free_port

    port = free_port()
    config = LaunchConfig(
        plan.tasks, plan.models, port, plan.threads, plan.device, out, cache_dir, plan.request_timeout_s,
        dtype=plan.dtype,
    )
    launch = SYSTEMS[name](config)
    info: dict[str, Any] = {"tasks": list(launch.tasks), "skipped": dict(launch.skipped), "argv": launch.argv}
    rec.results["systems"][name] = info
    for task, why in launch.skipped.items():
        log.warning("%s cannot serve %s: %s", name, task, why)
        progress.done += len(plan.concurrency) + (len(plan.poisson_rates) if task == "generate" else 0)
    if not launch.tasks:
        return
    with ServerProcess(name, launch.argv, port, out / f"{name}.log", launch.env, plan.threads) as proc:
        try:
            info["startup_s"] = proc.wait_ready(plan.ready_timeout_s, path=launch.ready_path)
        except StartError as e:
            log.error("%s", e)
            info["error"] = str(e)
            progress.done += sum(
                len(plan.concurrency) + (len(plan.poisson_rates) if t == "generate" else 0)
                for t in launch.tasks
            )
            return
        log.info("%s: ready in %.1f s", name, info["startup_s"])
        asyncio.run(run_system(name, proc.url, launch.tasks, plan, work, rec, progress, launch.openapi))
    rec.save()
