"""LoRA adapters on the shipped generator: what serving rows of many adapters costs, and how fast one loads,
next to llama.cpp's llama-server with the same adapter (`--lora`).

    python -m loadtests.models.adapters [--streams 32] [--adapters 8] [--rank 16] [--seconds 20]
                                        [--skip-llama] [--out .bench/adapters]   (make bench-adapters)

Ours, in this process: the shipped SmolLM2 (deploy/serve_config.yaml: q4_1 blocks on our kernels, its
engine settings, prefix cache off so every request computes its prompt) with `--adapters` slots of rank
`--rank`, filled with random PEFT adapters on every attention and MLP projection (written under --out,
as PEFT saves them). Loads: each adapter read from its directory and written into a slot, timed. Runs, in
turn (base, adapters, base, adapters...: a busy machine shows in both): `--streams` clients in a closed
loop for `--seconds` (each sends the next request when its answer is whole: a chat prompt of
loadtests/prompts/, greedy, max_new_tokens tokens, end of sequence ignored), either every request on the
bare model or request i on adapter i mod N; then one client alone, bare and on adapter 0. Figure: output
tokens per second over the measured window (the engine's count, prefill included). Last in each round,
one client whose requests alternate bare / adapter 0 for --seconds: each kind's tokens over its own
requests' time, a pair of figures no drift of the machine's speed between windows can split.

llama.cpp (the build of loadtests/peers/env.py): adapter 0 converted by its convert_lora_to_gguf.py against
the HF copy of SmolLM2 that `make peers-servers` keeps (.peers/smollm2-hf), then llama-server on the same
Q4_1 GGUF alone and with `--lora`, one client, the same prompts: tok/s, and the seconds from its start to
/health both ways. Prints the table; writes it (adapters.md) and results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from loadtests.peers.env import ROOT, PeerEnv, PeerFailed

log = logging.getLogger("bench.adapters")
HF_SMOLLM2 = ROOT / ".peers" / "smollm2-hf"


def make_adapters(model: Any, n: int, rank: int, root: Path) -> list[Path]:
    """`n` random rank-`rank` PEFT adapters of `model` on every projection, under root/a<i>."""
    from models.adapters.peft import random_llama_factors, save_adapter

    return [save_adapter(root / f"a{i}", random_llama_factors(model, rank, seed=i, std=0.02), rank, 2 * rank)
            for i in range(n)]


def closed_loop(engine: Any, prompts: list[list[int]], streams: int, seconds: float, warmup: float,
                adapters: list[str] | None, max_new: int) -> dict[str, float]:
    """`streams` clients in a closed loop on a started engine; request i on adapters[i % N] (None: the
    bare model). Output tok/s over the window after `warmup` seconds (the engine's own count)."""
    from models.decoding import SamplingParams
    from service.engine.core import Submission

    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    stop = threading.Event()
    sent = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        while not stop.is_set():
            with lock:
                i = sent[0]
                sent[0] += 1
            held = engine.adapters.acquire(adapters[i % len(adapters)]) if adapters else None
            try:
                handle = engine.submit_many([Submission(prompts[i % len(prompts)], params, adapter=held)])[0]
            except Exception:
                if held is not None:
                    engine.adapters.release(held.slot)
                raise
            done = handle.result_sync(timeout=600)
            if done.error is not None:
                raise RuntimeError(done.error)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(streams)]
    for t in threads:
        t.start()
    time.sleep(warmup)
    before, started = engine.stats().generated_tokens, time.perf_counter()
    time.sleep(seconds)
    after, ended = engine.stats().generated_tokens, time.perf_counter()
    stop.set()
    for t in threads:
        t.join(timeout=600)
    return {"tok_s": (after - before) / (ended - started), "requests": sent[0]}


def interleaved(engine: Any, prompts: list[list[int]], seconds: float, adapter: str, max_new: int) -> dict[str, float]:
    """One client alone for `seconds`, its requests alternately on the bare model and on `adapter` (the
    same prompt for each pair): each kind's output tok/s over its own requests' wall time (prefill
    included), so a machine whose speed drifts moves both alike."""
    from models.decoding import SamplingParams
    from service.engine.core import Submission

    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    tokens = {"base": 0, "adapters": 0}
    spent = {"base": 0.0, "adapters": 0.0}
    first = {"base": [], "adapters": []}  # each request's time to first token
    step = {"base": [], "adapters": []}  # each request's mean time per token after the first
    ended = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < ended or i % 2:
        kind = "adapters" if i % 2 else "base"
        held = engine.adapters.acquire(adapter) if i % 2 else None
        started = time.perf_counter()
        done = engine.submit_many([Submission(prompts[(i // 2) % len(prompts)], params, adapter=held)])[0] \
            .result_sync(timeout=600)
        spent[kind] += time.perf_counter() - started
        if done.error is not None:
            raise RuntimeError(done.error)
        tokens[kind] += len(done.token_ids)
        first[kind].append(done.timing.first_token_s)
        step[kind].append(statistics.mean(done.timing.inter_token_s))
        i += 1
    return ({kind: tokens[kind] / spent[kind] for kind in tokens} | {"pairs": i // 2}
            | {f"{kind}_ttft_ms": 1000 * statistics.median(first[kind]) for kind in first}
            | {f"{kind}_step_ms": 1000 * statistics.median(step[kind]) for kind in step})


def run_ours(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Load the shipped generator with adapter slots, time the adapters' loads, run the closed loops."""
    import dataclasses

    import torch

    from loadtests.experiments.engine_models import shipped_generator, shipped_generator_engine
    from models.adapters import read_adapter
    from models.catalog import load_model
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine, engine_runtime
    from service.replica.threads import on_own_thread

    torch.set_num_threads(args.threads)
    spec, dtype, cache_dir = shipped_generator()
    spec = dataclasses.replace(spec, max_adapters=args.adapters, max_lora_rank=args.rank)
    fields = shipped_generator_engine(prefix_cache_mib=0, speculative=None)
    fields["max_running"] = max(fields["max_running"], args.streams)
    config = EngineConfig(**fields)
    torch_dtype = None if dtype == "auto" else getattr(torch, dtype)
    loaded = on_own_thread(lambda: load_model(spec, cache_dir, dtype=torch_dtype, runtime=engine_runtime(config)))
    paths = on_own_thread(lambda: make_adapters(loaded.model, args.adapters, args.rank, args.out / "adapters"))
    loads = []
    for path in paths:  # each on a thread that ends, as a replica loads one (one OpenMP pool: replica/threads.py)
        started = time.perf_counter()
        on_own_thread(lambda path=path: loaded.adapters.load(read_adapter(path)))
        loads.append(time.perf_counter() - started)
    names = [p.name for p in paths]
    engine = on_own_thread(lambda: GenerationEngine(loaded.executor, loaded.tokenizer, config,
                                                    adapters=loaded.adapters)).start()
    mib = on_own_thread(lambda: read_adapter(paths[0]).nbytes / 2**20)
    out: dict[str, Any] = {"plan": engine.plan.summary(), "load_s": loads, "adapter_mib": mib, "runs": []}
    try:
        for which in (None, names[:1]):  # first calls (oneDNN primitives, buffers) before any window
            closed_loop(engine, prompts, 2, 0.5, 0.5, which, 8)
        for rnd in range(args.rounds):
            for label, streams, which in (("base", args.streams, None), ("adapters", args.streams, names),
                                          ("base", 1, None), ("adapters", 1, names[:1])):
                fig = closed_loop(engine, prompts, streams, args.seconds, args.warmup, which, args.max_new_tokens)
                out["runs"].append({"round": rnd, "label": label, "streams": streams, **fig})
                log.info("ours round %d, %d streams, %s: %.1f tok/s", rnd, streams, label, fig["tok_s"])
            pair = interleaved(engine, prompts, args.seconds, names[0], args.max_new_tokens)
            out.setdefault("interleaved", []).append({"round": rnd, **pair})
            log.info("ours round %d, 1 stream interleaved: base %.1f, adapter %.1f tok/s (%d pairs); time to "
                     "first token %.1f / %.1f ms, per token after it %.2f / %.2f ms", rnd, pair["base"],
                     pair["adapters"], pair["pairs"], pair["base_ttft_ms"], pair["adapters_ttft_ms"],
                     pair["base_step_ms"], pair["adapters_step_ms"])
    finally:
        engine.shutdown()
    return out


def convert_lora(env: PeerEnv, adapter: Path, out: Path, outtype: str) -> Path:
    """Adapter -> llama.cpp's LoRA GGUF (`outtype`) with its converter, against the HF SmolLM2 (PeerFailed
    if it refuses)."""
    script = next(iter(sorted((ROOT / ".peers").glob("llama_cpp_python-*/vendor/llama.cpp/convert_lora_to_gguf.py"))),
                  None)
    if script is None or not HF_SMOLLM2.is_dir():
        raise PeerFailed("no convert_lora_to_gguf.py or HF SmolLM2 under .peers (make peers, make peers-servers)")
    target = out / f"a0.{outtype}.gguf"
    gguf_py = script.parent / "gguf-py"
    done = subprocess.run([sys.executable, str(script), "--base", str(HF_SMOLLM2), "--outfile", str(target),
                           "--outtype", outtype, str(adapter)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(gguf_py), "PATH": "/usr/bin:/bin"}, timeout=600)
    if done.returncode != 0 or not target.exists():
        raise PeerFailed(f"convert_lora_to_gguf.py failed: {(done.stderr.strip().splitlines() or [''])[-1][:300]}")
    return target


def run_llama(args: argparse.Namespace, prompts: list[list[int]], adapter: Path) -> dict[str, Any]:
    """llama-server on the Q4_1 GGUF alone and with --lora: one client's tok/s and its start seconds."""
    from loadtests.models.speculative import complete, llama_server
    from models import zoo

    env = PeerEnv()
    if not env.has_llama:
        raise PeerFailed("llama.cpp is not built (make peers)")
    (name,) = zoo.ZOO["smollm2"].files
    q4 = zoo.resolve("smollm2", zoo.default_cache_dir()) / name
    loras = {kind: convert_lora(env, adapter, args.out, kind) for kind in args.llama_lora_types}
    ctx = max(len(p) for p in prompts) + args.max_new_tokens + 16
    out: dict[str, Any] = {"version": env.llama_version(), "runs": []}
    for rnd in range(args.rounds):
        for kind, extra in ((None, []), *((k, ["--lora", str(f)]) for k, f in loras.items())):
            label = "base" if kind is None else "adapters"
            started = time.perf_counter()
            with llama_server(env.tool("llama-server"), q4, args.threads, ctx, extra,
                              args.out / f"llama-server.{label}.log") as url:
                up = time.perf_counter() - started
                complete(url, prompts[0], 8)  # warm-up
                tokens, wall, deadline = 0, 0.0, time.perf_counter() + args.seconds
                i = 0
                while time.perf_counter() < deadline:
                    r = complete(url, prompts[i % len(prompts)], args.max_new_tokens)
                    tokens, wall, i = tokens + len(r["tokens"]), wall + r["wall_s"], i + 1
            out["runs"].append({"round": rnd, "label": label, "kind": kind, "streams": 1, "tok_s": tokens / wall,
                                "start_s": up})
            log.info("llama.cpp round %d, %s %s: %.1f tok/s, up in %.2f s", rnd, label, kind or "", tokens / wall, up)
    return out


def median_rate(runs: list[dict[str, Any]], label: str, streams: int) -> float | None:
    rates = [r["tok_s"] for r in runs if r["label"] == label and r["streams"] == streams]
    return statistics.median(rates) if rates else None


def round_ratios(runs: list[dict[str, Any]], streams: int) -> list[float]:
    """adapters / bare of each round's two windows (run back to back: a machine whose speed drifts over
    the rounds moves both), in round order; none for runs without rounds."""
    rates: dict[tuple[int, str], float] = {(r["round"], r["label"]): r["tok_s"] for r in runs
                                           if r["streams"] == streams and "round" in r}
    return [rates[n, "adapters"] / rates[n, "base"] for n in sorted({n for n, _ in rates})
            if (n, "base") in rates and (n, "adapters") in rates]


def markdown(result: dict[str, Any]) -> str:
    ours, llama = result["ours"], result.get("llama.cpp", {})
    lines = [f"LoRA adapters on {result['machine']['cpu_model']}, {result['machine']['nproc']} cores ({result['date']}): {result['adapters']} adapters of rank "
             f"{result['rank']} on every attention and MLP projection; median of {result['rounds']} rounds of "
             f"{result['seconds']:.0f} s; output tok/s, prefill included.", "",
             "| engine | streams | bare model | adapters | adapters / bare | each round | median of rounds |",
             "|---|---:|---:|---:|---:|---|---:|"]

    notes: list[str] = []

    def row(engine: str, runs: list[dict[str, Any]], streams: int, what: str) -> None:
        base, adapted = median_rate(runs, "base", streams), median_rate(runs, "adapters", streams)
        if base is None or adapted is None:
            return
        rounds = round_ratios(runs, streams)
        each = ", ".join(f"{r:.2f}x" for r in rounds)
        paired = f"**{statistics.median(rounds):.2f}x**" if rounds else ""
        lines.append(f"| {engine} | {streams} ({what}) | {base:.1f} | {adapted:.1f} | {adapted / base:.2f}x | {each} "
                     f"| {paired} |")

    if "runs" in ours:
        row("ours (q4_1, native step)", ours["runs"], result["streams"], f"{result['adapters']} adapters")
        row("ours (q4_1, native step)", ours["runs"], 1, "adapter 0")
    if ours.get("interleaved"):
        pairs = ours["interleaved"]
        ratios = [p["adapters"] / p["base"] for p in pairs]
        lines.append(f"| ours, requests alternating bare / adapter | 1 (adapter 0) "
                     f"| {statistics.median(p['base'] for p in pairs):.1f} "
                     f"| {statistics.median(p['adapters'] for p in pairs):.1f} | "
                     f"{statistics.median(p['adapters'] for p in pairs) / statistics.median(p['base'] for p in pairs):.2f}x "
                     f"| {', '.join(f'{r:.2f}x' for r in ratios)} | **{statistics.median(ratios):.2f}x** |")
        if all("base_ttft_ms" in p for p in pairs):
            def med(key: str) -> float:
                return statistics.median(p[key] for p in pairs)
            notes.append(f"Alternating requests, medians of the rounds: time to first token {med('base_ttft_ms'):.1f} ms "
                         f"bare, {med('adapters_ttft_ms'):.1f} ms with the adapter; per token after it "
                         f"{med('base_step_ms'):.2f} / {med('adapters_step_ms'):.2f} ms.")
    for kind in result.get("llama_lora_types", []) if "runs" in llama else []:
        row(f"llama.cpp `--lora` ({kind} GGUF)", [r for r in llama["runs"] if r["kind"] in (None, kind)], 1,
            "adapter 0")
    lines.append("")
    lines += notes
    if "load_s" in ours:
        loads = ours["load_s"]
        lines.append(f"Adapter load (read the PEFT directory, write a slot; {ours['adapter_mib']:.1f} MiB each): "
                     f"median {statistics.median(loads):.3f} s, max {max(loads):.3f} s over {len(loads)}.")
    if "runs" in llama:
        ups = {kind: statistics.median(r["start_s"] for r in llama["runs"] if r["kind"] == kind)
               for kind in [None, *result["llama_lora_types"]]}
        lines.append(f"llama.cpp ({llama['version']}): llama-server start to /health {ups.pop(None):.2f} s alone, "
                     + ", ".join(f"{v:.2f} s with the {k} `--lora`" for k, v in ups.items())
                     + " (it loads adapters at start only).")
    for engine in ("ours", "llama.cpp"):
        if "error" in result.get(engine, {}):
            lines.append(f"{engine}: not run ({result[engine]['error']}).")
    if "plan" in ours:
        lines.append(f"Our plan: `{ours['plan']}`.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--llama-lora-types", type=lambda v: v.split(","), default=["f16", "f32"],
                   help="convert_lora_to_gguf.py --outtype values to run llama-server with")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / ".bench" / "adapters")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    from loadtests.models.speculative import load_workloads, render
    from models.machine import machine_info

    prompts = render(load_workloads(["chat"], 16))[0]["chat"]
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
                              "streams": args.streams, "adapters": args.adapters, "rank": args.rank,
                              "seconds": args.seconds, "rounds": args.rounds, "ours": {}, "llama.cpp": {},
                              "llama_lora_types": args.llama_lora_types}
    if not args.skip_ours:
        result["ours"] = run_ours(args, prompts)
    if not args.skip_llama:
        try:
            adapter = args.out / "adapters" / "a0"
            if not adapter.exists():
                from loadtests.experiments.engine_models import shipped_generator
                from models.catalog import load_model

                spec, _, cache_dir = shipped_generator()
                make_adapters(load_model(spec, cache_dir).model, 1, args.rank, args.out / "adapters")
            result["llama.cpp"] = run_llama(args, prompts, adapter)
        except PeerFailed as e:
            result["llama.cpp"] = {"error": e.why}
    table = markdown(result)
    print(table)
    (args.out / "adapters.md").write_text(table)
    (args.out / "results.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
