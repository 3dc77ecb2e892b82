"""Side-by-side serving benchmark: ours vs plain transformers vs Ray Serve's `@serve.batch`.

    python -m loadtests.bench                                   # = make bench-serve: everything, defaults
    python -m loadtests.bench --tasks classify --systems ours,plain --models tiny \\
        --concurrency 1,8 --duration 3 --out /tmp/bench --docs /tmp/bench/benchmarks.md
    python -m loadtests.bench --report-only --out .bench     # tables, plots, docs again from results.json

Starts one system at a time (serving every requested task), waits for its /readyz, runs each task at
each load level against it, stops it (SIGTERM, then its process group), then starts the next. Every
system serves the same weights on the same device with the same torch threads. Writes
<out>/results.json (after every run, so an interrupted benchmark keeps what it measured),
<out>/results.md, PNG plots in <out>, and the generated section of docs/benchmarks.md (between
markers; the rest of the file is left alone). Server logs: <out>/<system>.log.

With the defaults (3 systems x (3 tasks x 4 levels + 1 Poisson run), 2 + 10 s each plus drains of
saturated runs and three start-ups) a full run takes about 13-15 minutes on 2 cores; --duration,
--warmup, --drain and --settle scale it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .loadgen import Timing
from .plan import Plan, Workloads, build_workloads
from .runner import Progress, Recorder, bench_system

log = logging.getLogger("loadtests.bench")
ROOT = Path(__file__).resolve().parent.parent


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    return lambda text: tuple(kind(x) for x in text.split(",") if x.strip())


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tasks", type=_csv(str), default=("classify", "translate", "generate"))
    p.add_argument("--systems", type=_csv(str), default=("ours", "plain", "serve_batch", "vllm_cpu_bf16"),
                   help="vllm_cpu_bf16 (vLLM in its best CPU mode) serves generation only, once `make peers-servers` "
                        "has installed it; else its rows say so")
    p.add_argument(
        "--concurrency", type=_csv(int), default=(1, 8, 32, 64), help="closed-loop clients per level"
    )
    p.add_argument(
        "--poisson-rates",
        type=_csv(float),
        default=(0.5,),
        help="generation open-loop arrival rates (req/s); empty string: none",
    )
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each run's window")
    p.add_argument(
        "--drain", type=float, default=8.0, help="longest wait for in-flight requests after the window"
    )
    p.add_argument(
        "--models", default="default", help="model set: default (the service's) or tiny (development)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="torch threads per model in every system (default: CPUs - 1, leaving one for HTTP)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N], for every system")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: each system's default (ours: the shipped config, where the generator is "
                        "auto-bf16; the alternatives: bfloat16 on cuda, float32 on cpu); else every model "
                        "of every system in this dtype")
    p.add_argument("--compare-at", type=int, default=32, help="concurrency of the ours-vs-alternative ratios")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ignore-eos",
        choices=("auto", "on", "off"),
        default="auto",
        help="generation: ask for exactly max_tokens (ignore_eos) or greedy until EOS. auto: on only if "
        "the first system measured accepts it (ours by default), so every system does the same work",
    )
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a system may take to load")
    p.add_argument(
        "--request-timeout", type=float, default=120.0, help="client timeout; ours' deadline is raised to it"
    )
    p.add_argument(
        "--settle", type=float, default=20.0, help="longest wait for a server to go idle after a run"
    )
    p.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--out", type=Path, default=ROOT / ".bench")
    p.add_argument(
        "--docs",
        type=Path,
        default=ROOT / "docs" / "benchmarks.md",
        help="markdown file whose generated section is replaced",
    )
    p.add_argument("--no-docs", action="store_true", help="do not touch the docs file")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="print the plan, the time estimate and the request pools' shapes, then stop",
    )
    p.add_argument(
        "--report-only", action="store_true", help="rebuild tables, plots and docs from <out>/results.json"
    )
    args = p.parse_args(argv)
    from .systems.launchers import SYSTEMS
    from .systems.modelsets import TASKS

    for name, given, known in (("task", args.tasks, TASKS), ("system", args.systems, tuple(SYSTEMS))):
        unknown = [x for x in given if x not in known]
        if unknown:
            p.error(f"unknown {name}(s) {unknown}; known: {list(known)}")
    if min(args.concurrency, default=1) < 1 or args.duration <= 0:
        p.error("--concurrency levels must be >= 1 and --duration > 0")
    return args


def plan_from(args: argparse.Namespace) -> Plan:
    return Plan(
        args.tasks,
        args.systems,
        args.concurrency,
        args.poisson_rates,
        Timing(args.warmup, args.duration, args.drain),
        args.models,
        args.threads,
        args.device,
        args.compare_at,
        args.seed,
        args.ignore_eos,
        args.ready_timeout,
        args.request_timeout,
        args.settle,
        args.progress,
        args.dtype,
    )


# -- reports ------------------------------------------------------------------------------------------


def write_reports(results: dict[str, Any], out: Path, docs: Path | None) -> None:
    from .plots import write_plots
    from .report import markdown, update_docs

    try:
        plots = write_plots(results, out)
    except Exception:  # the numbers matter more than the pictures
        log.exception("plotting failed; writing the tables without plots")
        plots = []
    section = markdown(results, [str(_display(out / p)) for p in plots])
    (out / "results.md").write_text(section)
    log.info("wrote %s, %s and %d plots", out / "results.json", out / "results.md", len(plots))
    if docs is not None:
        update_docs(docs, section)
        log.info("updated the generated section of %s", docs)


def _display(path: Path) -> Path:
    try:
        return path.resolve().relative_to(ROOT)
    except ValueError:
        return path


def _meta(plan: Plan, argv: Sequence[str], cache_dir: Path, notes: dict[str, str]) -> dict[str, Any]:
    from models.machine import machine_info

    from .report import versions
    from .systems.modelsets import model_set

    specs = model_set(plan.models)
    settings = {**asdict(plan), **asdict(plan.timing)}
    settings.pop("timing")
    return {
        "command": "python -m loadtests.bench " + " ".join(shlex.quote(a) for a in argv)
        if argv
        else "python -m loadtests.bench",
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "versions": versions(),
        "settings": settings,
        "notes": notes,
        "cache_dir": str(cache_dir),
        "models": {
            t: {"name": specs[t].name, "source": specs[t].source, "head": specs[t].head} for t in plan.tasks
        },
    }


def _describe(work: Workloads) -> None:
    def spread(xs: Sequence[int]) -> str:
        xs = sorted(xs)
        return f"min {xs[0]}, median {xs[len(xs) // 2]}, p95 {xs[int(0.95 * (len(xs) - 1))]}, max {xs[-1]}"

    log.info("classify texts (words): %s", spread([len(r.body["inputs"].split()) for r in work.classify]))
    log.info("translate texts (words): %s", spread([len(r.body["inputs"].split()) for r in work.translate]))
    if work.generate:
        log.info("generate prompts (tokens): %s", spread([it.prompt_tokens for it in work.generate]))
        log.info("generate outputs (max tokens): %s", spread([it.max_tokens for it in work.generate]))
    for task, note in work.notes.items():
        log.info("%s: %s", task, note)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    docs = None if args.no_docs else args.docs
    if args.report_only:
        write_reports(json.loads((out / "results.json").read_text()), out, docs)
        return 0

    from models.zoo import default_cache_dir

    plan = plan_from(args)
    cache_dir = default_cache_dir()
    total = len(plan.systems) * plan.runs_per_system()
    log.info(
        "plan: systems %s, tasks %s, clients %s, Poisson %s req/s; %g + %g s per run (+ drain <= %g s): "
        "%d runs, about %.0f min",
        ",".join(plan.systems),
        ",".join(plan.tasks),
        ",".join(map(str, plan.concurrency)),
        ",".join(f"{r:g}" for r in plan.poisson_rates) or "none",
        plan.timing.warmup_s,
        plan.timing.duration_s,
        plan.timing.drain_s,
        total,
        plan.estimate_s() / 60,
    )
    work = build_workloads(plan, cache_dir)
    if args.plan_only:
        _describe(work)
        return 0
    rec = Recorder(out, _meta(plan, argv, cache_dir, work.notes))
    started = time.monotonic()
    progress = Progress(total, plan.estimate_s())
    try:
        for name in plan.systems:
            bench_system(name, plan, work, rec, progress, out, os.environ.get("TRANSFORMER_SERVE_CACHE"))
    finally:
        rec.results["meta"]["finished"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        rec.results["meta"]["wall_s"] = time.monotonic() - started
        rec.save()
    write_reports(rec.results, out, docs)
    failed = [n for n, s in rec.results["systems"].items() if s.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
