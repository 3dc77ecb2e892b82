"""Speculative decoding at batch 1: our engine next to llama.cpp's llama-server, same prompts and weights.

    python -m loadtests.models.speculative [--prompts 8] [--max-new-tokens 256] [--workloads grounded,chat]
                                           [--modes "f32,f32 + q4_1 draft"] [--skip-ours] [--skip-llama]
                                           [--out .bench/spec]  (make bench-spec)

Workloads are loadtests/prompts/NAME.jsonl: grounded (rewrite, extract or summarise a ~300-token
passage: the answer copies spans of the prompt, where prompt lookup pays) and chat (free-form answers
that copy nothing). Each prompt is rendered by our tokenizer's chat template, and both engines get the
same token ids. Modes (MODES), each on both engines: the shipped q4_1 weights plain and with prompt
lookup, float32 plain, with prompt lookup, and with the q4_1 blocks drafting for it. Ours: a
GenerationEngine without Ray (shipped engine settings, prefix cache off), one process per mode. llama.cpp:
llama-server (the build of loadtests/peers/env.py) per mode, its /completion route streamed, prompt cache
off; its prompt lookup is the fastest of NGRAM_TYPES on the first prompt. Every request is greedy and
alone, each timed prompt sent once, after one untimed warm-up request (WARMUP) per engine and mode. One
pass, ours then llama.cpp per mode: no rounds, so a busy machine shows in the figures.

Figures, over a workload's prompts, both taken by the caller: tok/s = output tokens / wall seconds
(prefill included), decode tok/s = (output tokens - 1) / (wall - time to first token). Ratios are of
decode tok/s. "identical" counts the prompts whose output tokens equal the same engine's plain run on
the same weights (greedy speculation must not change them). Prints the table; writes it (spec.md),
every run's tokens and times (results.json) and the servers' logs under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.peers.env import ROOT, PeerEnv, PeerFailed, exit_reason
from loadtests.systems.process import ServerProcess, StartError, free_port

log = logging.getLogger("bench.spec")
PROMPTS_DIR = ROOT / "loadtests" / "prompts"
WORKLOADS = ("grounded", "chat")
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")  # llama-server's prompt lookups, tried in turn
SERVER_START_S = 120.0
REQUEST_TIMEOUT_S = 600.0
WORKER_TIMEOUT_S = 1800.0  # one of our modes: load (compiles blocks, ~15 s) and every workload
COUNTED = ("steps", "spec_steps", "spec_drafted", "spec_accepted", "spec_draft_steps")  # EngineStats totals kept per workload
# Each engine's warm-up: a prompt past one prefill chunk whose answer shares nothing with the timed ones
# (llama.cpp's ngram-mod keeps its n-grams across requests: a timed prompt seen before would be recalled).
WARMUP = [{"role": "user", "content": "Here is a list of numbers: " + ", ".join(map(str, range(1, 81)))
           + ". Write the same numbers again in words, from the largest to the smallest."}]


@dataclass(frozen=True)
class Mode:
    """One configuration, run on both engines: the target's weights and how it drafts (None: plain)."""

    name: str
    weights: str  # "q4_1" (the shipped blocks) | "f32" (the same weights, dequantized)
    drafting: str | None = None  # None | "ngram" (prompt lookup) | "draft" (the q4_1 blocks as a draft model)

    @property
    def plain(self) -> str:
        """The mode whose outputs this one's must equal: the same weights, no drafting."""
        return self.weights


MODES = (Mode("q4_1", "q4_1"), Mode("q4_1 + ngram", "q4_1", "ngram"), Mode("f32", "f32"),
         Mode("f32 + ngram", "f32", "ngram"), Mode("f32 + q4_1 draft", "f32", "draft"))
BY_NAME = {m.name: m for m in MODES}


def load_workloads(names: list[str], n: int) -> dict[str, list[dict[str, Any]]]:
    """The first `n` prompts of each workload file ({"id", "task", "messages"} per line)."""
    out = {}
    for name in names:
        lines = (PROMPTS_DIR / f"{name}.jsonl").read_text().splitlines()
        out[name] = [json.loads(line) for line in lines if line.strip()][:n]
    return out


def render(workloads: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, list[list[int]]], list[int]]:
    """Each prompt's token ids, and WARMUP's: the shipped generator's chat template, encoded as the
    service does (the template writes the special tokens)."""
    from loadtests.experiments.engine_models import shipped_generator
    from models.catalog import LOADERS, resolve_dir
    from models.text import TextTokenizer

    spec, _, cache_dir = shipped_generator()
    scheme, _, rest = spec.source.partition(":")
    _, tok = LOADERS[scheme](rest, cache_dir)
    if spec.tokenizer is not None:
        tok = TextTokenizer.from_file(resolve_dir(spec.tokenizer, cache_dir))

    def ids(messages: list[dict[str, str]]) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)

    return {w: [ids(p["messages"]) for p in ps] for w, ps in workloads.items()}, ids(WARMUP)


# --- ours: one process per mode ---------------------------------------------------------------------

def ours_worker(mode: Mode, job: dict[str, Any]) -> dict[str, Any]:
    """In this process: load the shipped generator for `mode`, run job["prompts"] (workload -> ids) on a
    GenerationEngine, one request at a time, after a warm-up request (job["warmup"]). A drafting mode
    also runs each prompt opted out of drafting (`speculative: false`, the plain tokens), alternately
    first and second, so that its ratio to plain decoding is taken in one process over the same time.
    Returns {"plan", "runs": {workload: [run]}, "counts": {workload: COUNTED's totals over its runs}}
    and, for a drafting mode, "opted_out": {workload: [run]}; a run being {"tokens", "wall_s", "ttft_s"}."""
    import dataclasses

    import torch

    from loadtests.experiments.engine_models import shipped_generator, shipped_generator_engine
    from models.catalog import load_model
    from models.decoding import SamplingParams
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine, engine_runtime
    from service.replica.threads import on_own_thread

    torch.set_num_threads(job["threads"])
    spec, dtype, cache_dir = shipped_generator()
    torch_dtype = None if dtype == "auto" else getattr(torch, dtype)
    fields = shipped_generator_engine(prefix_cache_mib=0)  # as llama.cpp's cache_prompt false
    if mode.drafting is not None:
        from service.engine.config import SpeculativeConfig

        k = job["ngram_k"] if mode.drafting == "ngram" else job["draft_k"]
        extra = {"draft": {"quantize": "q4_1"}} if mode.drafting == "draft" else {}
        fields["speculative"] = SpeculativeConfig(method=mode.drafting, max_draft_tokens=k, **extra)
    elif "speculative" in fields:
        fields["speculative"] = None
    config = EngineConfig(**fields)
    runtime = engine_runtime(config)
    if mode.weights == "f32":
        spec = dataclasses.replace(spec, quantize=None, prompt_weights="same")

    def load() -> GenerationEngine:
        target = load_model(spec, cache_dir, dtype=torch_dtype, runtime=runtime)
        kwargs = {}
        if mode.drafting == "draft":
            draft_spec = dataclasses.replace(spec, quantize="q4_1", prompt_weights="same")
            kwargs["draft"] = load_model(draft_spec, cache_dir, dtype=torch_dtype, runtime=runtime).executor
        return GenerationEngine(target.executor, target.tokenizer, config, **kwargs)

    # loaded on a thread that ends, as a replica loads (service/replica/threads.py): the engine's thread
    # then has the process's only OpenMP pool
    engine = on_own_thread(load).start()
    params = SamplingParams(max_new_tokens=job["max_new"], temperature=0.0)
    opted_out = dataclasses.replace(params, speculative=False)

    def once(ids: list[int], params: SamplingParams = params) -> dict[str, Any]:
        start = time.perf_counter()
        done = engine.submit(ids, params).result_sync(timeout=REQUEST_TIMEOUT_S)
        wall = time.perf_counter() - start
        if done.error is not None:
            raise RuntimeError(f"request failed: {done.error}")
        return {"tokens": list(done.token_ids), "wall_s": wall, "ttft_s": done.timing.first_token_s}

    def counts() -> dict[str, int]:
        stats = engine.stats()
        return {k: getattr(stats, k, 0) for k in COUNTED}

    out: dict[str, Any] = {"plan": engine.plan.summary(), "runs": {}, "counts": {}}
    if mode.drafting:
        out["opted_out"] = {}
    try:
        once(job["warmup"])
        for w, prompts in job["prompts"].items():
            totals = dict.fromkeys(COUNTED, 0)
            out["runs"][w] = []
            for j, ids in enumerate(prompts):
                if mode.drafting and j % 2 == 0:
                    out["opted_out"].setdefault(w, []).append(once(ids, opted_out))
                before = counts()
                out["runs"][w].append(once(ids))
                totals = {k: totals[k] + v - before[k] for k, v in counts().items()}
                if mode.drafting and j % 2 == 1:
                    out["opted_out"].setdefault(w, []).append(once(ids, opted_out))
            out["counts"][w] = totals
    finally:
        engine.shutdown()
    return out


def run_ours(mode: Mode, job: dict[str, Any]) -> dict[str, Any]:
    """ours_worker(mode, job) in a process of its own (its log on our stderr); PeerFailed saying how it failed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(job["threads"])}
    argv = [sys.executable, "-m", "loadtests.models.speculative", "--worker", mode.name]
    try:
        done = subprocess.run(argv, input=json.dumps(job), stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                              timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PeerFailed(f"timed out after {WORKER_TIMEOUT_S:.0f} s") from None
    if done.returncode:
        raise PeerFailed(f"{exit_reason(done.returncode)} (its log above says why)")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- llama.cpp: llama-server per mode -----------------------------------------------------------------

@contextlib.contextmanager
def llama_server(binary: Path, model: Path, threads: int, ctx: int, extra: list[str],
                 log_path: Path) -> Iterator[str]:
    """llama-server on 127.0.0.1 (a free port, one slot) until /health answers 200; yields its base URL
    and stops it after. PeerFailed, with its log's tail, when it exits or does not come up."""
    port = free_port()
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", "1", "-c", str(ctx), *extra]
    log.info("$ %s", " ".join(argv))
    server = ServerProcess("llama-server", argv, port, log_path, threads=threads)
    server.start()
    try:
        try:
            server.wait_ready(SERVER_START_S, path="/health")
        except StartError as e:
            raise PeerFailed(str(e)) from e
        yield server.url
    finally:
        server.stop(grace_s=10)


def complete(url: str, ids: list[int], max_new: int) -> dict[str, Any]:
    """One greedy /completion of `ids`, streamed: {"tokens", "wall_s", "ttft_s" (first chunk with a token),
    "drafted", "accepted" (its timings' draft_n / draft_n_accepted, 0 without drafting), "spec_types" (the
    speculative types the server says it used, e.g. "none,ngram-mod")}."""
    body = json.dumps({"prompt": ids, "n_predict": max_new, "temperature": 0.0, "cache_prompt": False,
                       "return_tokens": True, "stream": True}).encode()
    req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    tokens: list[int] = []
    ttft, timings, settings = None, {}, {}
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("tokens") and ttft is None:
                    ttft = time.perf_counter() - start
                tokens += chunk.get("tokens", [])
                timings = chunk.get("timings", timings)
                settings = chunk.get("generation_settings", settings)
    except (OSError, ValueError) as e:
        raise PeerFailed(f"/completion failed: {e}") from None
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, "ttft_s": ttft, "drafted": timings.get("draft_n", 0),
            "accepted": timings.get("draft_n_accepted", 0), "spec_types": settings.get("speculative.types", "")}


def spec_type(mode: Mode, ngram: str) -> str | None:
    """llama-server's --spec-type for `mode` (None: plain)."""
    return {None: None, "ngram": ngram, "draft": "draft-simple"}[mode.drafting]


def llama_flags(mode: Mode, ngram: str, files: dict[str, Path], draft_k: int) -> list[str]:
    """llama-server's options for `mode` (--model-draft alone drafts nothing: it needs its --spec-type)."""
    kind = spec_type(mode, ngram)
    flags = [] if kind is None else ["--spec-type", kind]
    if mode.drafting == "draft":
        flags += ["--model-draft", str(files["q4_1"]), "--spec-draft-n-max", str(draft_k)]
    return flags


def check_drafting(run: dict[str, Any], kind: str | None) -> None:
    """PeerFailed when the server did not draft with `kind` (it names the types it used in each answer)."""
    if kind is not None and kind not in run["spec_types"].split(","):
        raise PeerFailed(f"llama-server drafted with {run['spec_types']!r}, not {kind}")


def run_llama(env: PeerEnv, mode: Mode, ngram: str, files: dict[str, Path], prompts: dict[str, list[list[int]]],
              warmup: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """llama-server for `mode`: {"runs": {workload: [run]}} as ours_worker's, after a warm-up request."""
    ctx = max(len(ids) for ps in [*prompts.values(), [warmup]] for ids in ps) + args.max_new_tokens + 16
    log_path = args.out / f"llama-server.{mode.name.replace(' ', '')}.log"
    flags = llama_flags(mode, ngram, files, args.draft_k)
    with llama_server(env.tool("llama-server"), files[mode.weights], args.threads, ctx, flags, log_path) as url:
        check_drafting(complete(url, warmup, args.max_new_tokens), spec_type(mode, ngram))
        runs = {w: [complete(url, ids, args.max_new_tokens) for ids in ps] for w, ps in prompts.items()}
    return {"runs": runs, "flags": flags}


def pick_ngram(env: PeerEnv, files: dict[str, Path], ids: list[int], warmup: list[int],
               args: argparse.Namespace) -> dict[str, Any]:
    """Each of NGRAM_TYPES on the q4_1 file and one prompt, after the warm-up request: {"best": the
    fastest by decode tok/s, "tried": {type: decode tok/s or why it failed}}."""
    tried: dict[str, float | str] = {}
    ctx = max(len(ids), len(warmup)) + args.max_new_tokens + 16
    for kind in NGRAM_TYPES:
        try:
            with llama_server(env.tool("llama-server"), files["q4_1"], args.threads, ctx, ["--spec-type", kind],
                              args.out / f"llama-server.{kind}.log") as url:
                check_drafting(complete(url, warmup, args.max_new_tokens), kind)
                tried[kind] = decode_rate([complete(url, ids, args.max_new_tokens)])
        except PeerFailed as e:
            tried[kind] = e.why
        log.info("llama.cpp %s: %s", kind, f"{tried[kind]:.1f} decode tok/s" if isinstance(tried[kind], float)
                 else tried[kind])
    rates = {k: v for k, v in tried.items() if isinstance(v, float)}
    return {"best": max(rates, key=rates.get) if rates else None, "tried": tried}


# --- figures and the table ----------------------------------------------------------------------------

def decode_rate(runs: list[dict[str, Any]]) -> float:
    """(output tokens - 1) / (wall - time to first token), summed over `runs`."""
    tokens = sum(max(len(r["tokens"]) - 1, 0) for r in runs)
    seconds = sum(r["wall_s"] - (r["ttft_s"] or 0.0) for r in runs)
    return tokens / seconds if seconds > 0 else 0.0


def figures(runs: list[dict[str, Any]], plain: list[dict[str, Any]] | None) -> dict[str, Any]:
    """tok/s end to end, decode tok/s, output tokens, and how many outputs equal `plain`'s."""
    tokens = sum(len(r["tokens"]) for r in runs)
    same = None if plain is None else sum(a["tokens"] == b["tokens"] for a, b in zip(runs, plain, strict=True))
    return {"tok_s": tokens / sum(r["wall_s"] for r in runs), "decode_tok_s": decode_rate(runs),
            "tokens": tokens, "same": same, "n": len(runs)}


def summarise(result: dict[str, Any]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """engine -> workload -> mode -> figures, for every mode that ran (a plain mode checked against nothing);
    a drafting mode's requests opted out of drafting in the same process (ours) under "opted_out"."""
    table: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for engine in ("ours", "llama.cpp"):
        per_mode = {m: r for m, r in result.get(engine, {}).items() if "runs" in r}
        for m, r in per_mode.items():
            plain = per_mode.get(BY_NAME[m].plain) if BY_NAME[m].drafting else None
            for w, runs in r["runs"].items():
                ref = None if plain is None else plain["runs"][w]
                f = table.setdefault(engine, {}).setdefault(w, {})[m] = figures(runs, ref)
                if w in r.get("opted_out", {}):
                    f["opted_out"] = figures(r["opted_out"][w], runs)
    return table


def _rate(f: dict[str, Any] | None, key: str, missing: str) -> str:
    return f"{f[key]:.1f}" if f else missing


def _same(f: dict[str, Any] | None) -> str:
    return "n/a" if not f else "(plain)" if f["same"] is None else f"{f['same']}/{f['n']}"


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    return f"{a['decode_tok_s'] / b['decode_tok_s']:.2f}x" if a and b and b["decode_tok_s"] else "n/a"


def _paired(f: dict[str, Any] | None) -> str:
    """A drafting mode's decode tok/s over its requests opted out in the same process, and its ratio."""
    if not f or "opted_out" not in f:
        return ""
    o = f["opted_out"]
    return f"{o['decode_tok_s']:.1f} ({o['same']}/{o['n']}) | {_ratio(f, o)}"


def markdown(result: dict[str, Any]) -> str:
    """The table (one row per workload and mode, ours and llama.cpp side by side) and its notes."""
    s = summarise(result)
    ours, llama = s.get("ours", {}), s.get("llama.cpp", {})
    ngram = result.get("llama_ngram", {}).get("best")
    no_o, no_l = ("skipped" if e in result["skipped"] else "failed" for e in ("ours", "llama.cpp"))
    box = result["machine"]
    lines = [f"### Speculative decoding, SmolLM2-135M, batch 1, greedy, up to {result['max_new_tokens']} new tokens "
             f"({result['date']})", "",
             f"{box.get('nproc')} CPUs ({box.get('cpu_model', '?')}), {result['threads']} threads for each engine; "
             f"llama.cpp: {result.get('llama.cpp version', 'not run')}.", "",
             "| workload | mode | ours tok/s | ours decode tok/s | ours identical | ours opted out: decode tok/s "
             "(identical) | ours / opted out | llama.cpp tok/s | llama.cpp decode tok/s | llama.cpp identical | "
             "ours / our plain | llama.cpp / its plain | ours / llama.cpp |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in result["workloads"]:
        for m in map(BY_NAME.get, result.get("modes", BY_NAME)):
            o, ll = ours.get(w, {}).get(m.name), llama.get(w, {}).get(m.name)
            op, lp = ours.get(w, {}).get(m.plain), llama.get(w, {}).get(m.plain)
            label = m.name + (f" ({ngram})" if m.drafting == "ngram" and ngram else "")
            lines.append(f"| {w} | {label} | {_rate(o, 'tok_s', no_o)} | {_rate(o, 'decode_tok_s', no_o)} | "
                         f"{_same(o)} | {_paired(o) or ' | '} | {_rate(ll, 'tok_s', no_l)} | {_rate(ll, 'decode_tok_s', no_l)} | {_same(ll)} | "
                         f"{_ratio(o, op) if m.drafting else ''} | {_ratio(ll, lp) if m.drafting else ''} | "
                         f"{_ratio(o, ll)} |")
    lines += ["", f"tok/s: output tokens / wall seconds per request (prefill included); decode tok/s: (output tokens "
              "- 1) / (wall - time to first token); both summed over the prompts and taken by the caller (ours "
              "around submit() .. result_sync(), llama.cpp around its streamed /completion), after one warm-up "
              "request (not a timed prompt); ratios are of decode tok/s. identical: outputs equal, token for token, to the same engine's plain "
              "run on the same weights. Ours opted out: the drafting mode's process also ran each prompt with "
              "`speculative: false` (alternately before and after the drafting request), identical to its "
              "drafting run; ours / opted out is its ratio taken over the same minutes (the one to quote on a "
              "machine whose speed drifts), ours / our plain the ratio to the plain mode's own process. "
              f"Ours: ngram k={result['ngram_k']}, draft k={result['draft_k']}; llama.cpp: "
              f"--spec-draft-n-max {result['draft_k']}, its ngram types with their defaults (ngram-mod's n-gram pool "
              "is shared across requests; ours is per request)."]
    picked = result.get("llama_ngram", {}).get("tried")
    if picked:
        lines.append("llama.cpp ngram: the fastest on the first prompt of " + result["workloads"][0] + " (q4_1): "
                     + ", ".join(f"{k} {v:.1f} decode tok/s" if isinstance(v, float) else f"{k} failed ({v})"
                                 for k, v in picked.items()) + ".")
    for engine in ("ours", "llama.cpp"):
        for m, r in result.get(engine, {}).items():
            if "error" in r:
                lines.append(f"{engine} {m}: failed ({r['error']}).")
    lines += _acceptance(result) + _across(result)
    return "\n".join(lines) + "\n"


def _acceptance(result: dict[str, Any]) -> list[str]:
    """Drafted tokens accepted, and output tokens per target step: ours generated / engine steps
    (prefill steps included), llama.cpp output / (output - accepted drafts)."""
    cells = []
    for engine in ("ours", "llama.cpp"):
        for m, r in result.get(engine, {}).items():
            if not BY_NAME[m].drafting or "runs" not in r:
                continue
            for w, runs in r["runs"].items():
                out = sum(len(x["tokens"]) for x in runs)
                if engine == "ours":
                    c = r["counts"][w]
                    acc, drafted, steps = c["spec_accepted"], c["spec_drafted"], c["steps"]
                else:
                    acc, drafted = sum(x["accepted"] for x in runs), sum(x["drafted"] for x in runs)
                    steps = out - acc
                cells.append(f"{engine} {m} {w}: {acc}/{drafted} accepted, {out / max(steps, 1):.2f}")
    return ["Drafts accepted, and output tokens per target step (ours: engine steps, prefill included; llama.cpp: "
            "output - its timings' draft_n_accepted): " + "; ".join(cells) + "."] if cells else []


def _across(result: dict[str, Any]) -> list[str]:
    """How many plain outputs are the same on both engines, per workload and weights (the same weights,
    each engine's own arithmetic)."""
    ours, llama = result.get("ours", {}), result.get("llama.cpp", {})
    cells = [f"{w} {m}: {sum(a['tokens'] == b['tokens'] for a, b in zip(runs, llama[m]['runs'][w], strict=True))}"
             f"/{len(runs)}"
             for m in ("q4_1", "f32") if "runs" in ours.get(m, {}) and "runs" in llama.get(m, {})
             for w, runs in ours[m]["runs"].items()]
    return ["Plain outputs identical on both engines: " + ", ".join(cells) + "."] if cells else []


# --- the run ------------------------------------------------------------------------------------------

def llama_setup(env: PeerEnv, args: argparse.Namespace) -> dict[str, Path]:
    """{"q4_1": the pinned GGUF, "f32": its weights as F32 (bench-peers' conversion)}, llama.cpp built
    first when it is not; PeerFailed when either cannot be had."""
    from models import zoo

    from ..peers.bench import llama_files

    (name,) = zoo.ZOO["smollm2"].files
    q4 = zoo.resolve("smollm2", zoo.default_cache_dir()) / name
    if not env.has_llama:
        try:
            env.ensure_llama(q4, args.threads)
        except Exception as e:  # no llama.cpp: its columns say why, ours still run
            raise PeerFailed(f"llama.cpp did not build: {(str(e).strip().splitlines() or [''])[0][:200]}") from None
    failed: dict[str, dict[str, str]] = {}
    files = llama_files(env, q4, ROOT / ".bench" / "peers", failed, None)
    if "llama.cpp F32" not in files:
        raise PeerFailed(next(iter(failed.get("llama.cpp F32", {}).values()), "no F32 GGUF"))
    return {"q4_1": files["llama.cpp Q4_1"], "f32": files["llama.cpp F32"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode on each engine not skipped, ours then llama.cpp per mode; a failure is that mode's
    {"error": why} and the rest go on."""
    workloads = load_workloads(args.workloads, args.prompts)
    prompts, warmup = render(workloads)
    from models.machine import machine_info

    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
                              "workloads": list(prompts),
                              "prompt_ids": {w: [p["id"] for p in ps] for w, ps in workloads.items()},
                              "prompt_tokens": {w: [len(ids) for ids in ps] for w, ps in prompts.items()},
                              "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                              "ngram_k": args.ngram_k, "draft_k": args.draft_k, "modes": args.modes,
                              "ours": {}, "llama.cpp": {},
                              "skipped": [e for e, skip in (("ours", args.skip_ours), ("llama.cpp", args.skip_llama))
                                          if skip]}
    job = {"prompts": prompts, "warmup": warmup, "threads": args.threads, "max_new": args.max_new_tokens, "ngram_k": args.ngram_k,
           "draft_k": args.draft_k}
    env, files, ngram = PeerEnv(), {}, None
    if not args.skip_llama:
        try:
            files = llama_setup(env, args)
            result["llama.cpp version"] = env.llama_version()
            result["llama_ngram"] = pick_ngram(env, files, next(iter(prompts.values()))[0], warmup, args)
            ngram = result["llama_ngram"]["best"]
        except PeerFailed as e:
            result["llama.cpp"] = {name: {"error": e.why} for name in args.modes}
    for m in map(BY_NAME.get, args.modes):
        if not args.skip_ours:
            log.info("ours %s", m.name)
            try:
                result["ours"][m.name] = run_ours(m, job)
            except PeerFailed as e:
                result["ours"][m.name] = {"error": e.why}
        if files:
            log.info("llama.cpp %s", m.name)
            if m.drafting == "ngram" and ngram is None:
                result["llama.cpp"][m.name] = {"error": "no ngram type of llama-server ran"}
                continue
            try:
                result["llama.cpp"][m.name] = run_llama(env, m, ngram or "", files, prompts, warmup, args)
            except PeerFailed as e:
                result["llama.cpp"][m.name] = {"error": e.why}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload (default all 8)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    p.add_argument("--threads", type=int, default=2, help="threads for every engine")
    p.add_argument("--ngram-k", type=int, default=8, help="our prompt lookup's most drafted tokens")
    p.add_argument("--draft-k", type=int, default=4, help="the draft model's tokens per step (both engines)")
    p.add_argument("--modes", default=",".join(BY_NAME),
                   help="comma-separated, of " + ", ".join(BY_NAME) + " (a ratio needs its plain mode too)")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / ".bench" / "spec", help="results.json, spec.md, server logs")
    p.add_argument("--worker", choices=list(BY_NAME), help=argparse.SUPPRESS)  # ours_worker; the job on stdin
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.worker:
        print(json.dumps(ours_worker(BY_NAME[args.worker], json.loads(sys.stdin.read()))))
        return 0
    if args.prompts < 1 or args.max_new_tokens < 1:
        p.error("--prompts and --max-new-tokens must be at least 1")
    args.workloads = args.workloads.split(",")
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        p.error(f"unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    args.modes = args.modes.split(",")
    unknown = sorted(set(args.modes) - set(BY_NAME))
    if unknown:
        p.error(f"unknown mode(s) {unknown}; known: {list(BY_NAME)}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / "spec.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
