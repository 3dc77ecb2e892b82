"""Ours next to llama.cpp, CTranslate2 and ONNX Runtime on the same weights, in one run.

    python -m loadtests.peers [--rounds 3] [--smoke] [--skip-llama] [--docs docs/benchmarks.md]
                                                                      (make bench-peers)

Sets up the peers' environment (.peers/, env.py; llama.cpp builds once, ~10 min), converts our
models (convert.py) and checks each conversion against our outputs, then times every engine in its own
process (worker.py) with the same thread count, the engines taking turns within each round; figures
are medians over rounds. A batch size's figure covers at least 16 texts (16 batches of 1, 2 of 8,
1 of 32), drawn once and given to every engine. `--smoke` is the short run `make test` does: one
round, small batches, a few check sentences, three of our variants per model (none compiled), no
llama.cpp build.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.models.bench import mixed_texts
from models import zoo
from models.catalog import BUILTIN_DIR
from models.machine import machine_info
from models.text import TextTokenizer

from ..report import update_docs
from .convert import f32_gguf
from .env import ROOT, PeerEnv

log = logging.getLogger("bench.peers")
TEST_SET = BUILTIN_DIR / "translator-en-es" / "test.tsv"
# Between two engines' turns: ONNX Runtime's and OpenMP's worker threads spin for a while after a
# call, which would steal the cores from the next engine; a pause lets them go to sleep.
SETTLE_S = 0.3
# a timed sample is the median of enough calls to span this long (at most MAX_REPEATS): a batch-1 item of
# 16 sentences takes ~80 ms, and one call's time on this VM swung 0.5x-1.4x of its neighbours'
SAMPLE_S = 0.5
MAX_REPEATS = 7
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
# our variants per model (worker.py modes, models.spec.variant): float ones face the peer's fp32, the
# rest its int8; "+a8": the block formats with 8-bit activations, llama.cpp's arithmetic (the
# translator's compiled blocks measured slower than eager: its per-step cost is outside them)
OURS = {"encoder": ("fp32", "fp32+compiled", "int8", "q8_0+compiled", "q8_0+a8+compiled"),
        "translator": ("fp32", "int8", "q8_0", "q8_0+a8"),
        "generator": ("fp32", "fp32+compiled", "q4_1+compiled", "q4_1+a8+compiled")}
# --smoke: one float, one int8 and one block variant each, none compiled (each compile is its own
# process's tens of seconds on 2 cores; tests/models/test_compiled.py covers compiled blocks)
SMOKE = {"encoder": ("fp32", "int8", "q8_0+a8"), "translator": ("fp32", "int8", "q8_0+a8")}


def _ours_workers(kind: str, smoke: bool = False) -> dict[str, Worker]:
    return {f"ours {m}": Worker(f"ours {m}", ours(kind, m)) for m in (SMOKE if smoke else OURS)[kind]}


@dataclass
class Worker:
    """An engine in its own process, driven over stdin/stdout (worker.py)."""

    name: str
    argv: list[str]
    proc: subprocess.Popen = field(init=False)

    def __post_init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=ROOT, env=env)
        self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited ({self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def call(self, **cmd: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, work: dict[str, Any]) -> Any:
        return self.call(op="run", work=work)["out"]

    def seconds(self, work: dict[str, Any], repeats: int) -> float:
        return self.call(op="time", work=work, repeats=repeats)["s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def alternate(workers: dict[str, Worker], works: dict[str, dict[str, Any]], rounds: int,
              repeats: dict[str, int], label: str, sample_s: float = SAMPLE_S) -> dict[str, dict[str, float]]:
    """Median seconds per (engine, work): a warm-up call each (timed), then rounds in which the engines
    take turns, each sample the median of at least repeats[work] calls, and of as many as span
    `sample_s` by the warm-up's time (at most MAX_REPEATS)."""
    calls: dict[str, dict[str, int]] = {e: {} for e in workers}
    for e, w in workers.items():
        for k, work in works.items():
            once = w.seconds(work, 1)
            calls[e][k] = max(repeats[k], min(MAX_REPEATS, math.ceil(sample_s / max(once, 1e-6))))
    samples: dict[str, dict[str, list[float]]] = {e: {k: [] for k in works} for e in workers}
    for r in range(rounds):
        start = time.monotonic()
        for k, work in works.items():
            for e, w in workers.items():
                time.sleep(SETTLE_S)
                samples[e][k].append(w.seconds(work, calls[e][k]))
        log.info("%s: round %d/%d done in %.0f s", label, r + 1, rounds, time.monotonic() - start)
    return {e: {k: statistics.median(v) for k, v in per.items()} for e, per in samples.items()}


def _close(workers: dict[str, Worker]) -> None:
    for w in workers.values():
        w.close()


def _calls(batch: int, args: argparse.Namespace) -> int:
    """Batches per timed work item: small batches get several (one sentence is a poor sample)."""
    return max(1, args.min_items // batch)


def _in_batches(rows: list[list[int]], size: int = 32) -> list[list[list[int]]]:
    return [rows[i: i + size] for i in range(0, len(rows), size)]


def _items(work: dict[str, Any]) -> int:
    return sum(len(batch) for batch in work["batches"])


def read_sources() -> list[str]:
    return [line.split("\t")[0] for line in TEST_SET.read_text().splitlines() if line.strip()]


def ours(kind: str, mode: str) -> list[str]:
    return [sys.executable, "-m", "loadtests.peers.worker", f"ours-{kind}", mode]


def peer(env: PeerEnv, engine: str, mode: str, path: Path) -> list[str]:
    return [str(env.python), "-m", "loadtests.peers.worker", engine, mode, str(path)]


def convert(env: PeerEnv, kind: str, out: Path) -> None:
    log.info("converting our %s for its peer into %s", kind, out)
    done = subprocess.run([str(env.python), "-m", "loadtests.peers.convert", kind, str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"converting the {kind} failed:\n{done.stderr[-4000:]}")


def bench_encoder(env: PeerEnv, work_dir: Path, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    tok = TextTokenizer.from_file(zoo.resolve("minilm", zoo.default_cache_dir()))
    convert(env, "encoder", work_dir / "onnx")
    workers = {**_ours_workers("encoder", args.smoke),
               "onnxruntime fp32": Worker("ort fp32", peer(env, "onnxruntime", "fp32", work_dir / "onnx" / "encoder.onnx")),
               "onnxruntime int8": Worker("ort int8", peer(env, "onnxruntime", "int8",
                                                               work_dir / "onnx" / "encoder.int8.onnx"))}
    try:
        texts = read_sources()[: args.check]
        check = {"kind": "encode", "batches": _in_batches(tok.encode_batch(texts))}
        outs = {}
        for e, w in workers.items():
            parts = w.run(check)
            outs[e] = {k: [x for part in parts for x in part[k]] for k in ("embedding", "label")}
        ref = outs["ours fp32"]
        quality = {}
        for e, o in outs.items():
            diff = max(abs(a - b) for u, v in zip(ref["embedding"], o["embedding"], strict=True)
                       for a, b in zip(u, v, strict=True))
            same = sum(a == b for a, b in zip(ref["label"], o["label"], strict=True)) / len(texts)
            quality[e] = {"max_abs_diff": diff, "same_label": same}
        if quality["onnxruntime fp32"]["max_abs_diff"] > 1e-5:
            raise RuntimeError(f"ONNX export differs from our encoder: {quality['onnxruntime fp32']}")
        works = {f"batch {b}": {"kind": "encode", "batches": [tok.encode_batch(mixed_texts(b, rng))
                                                               for _ in range(_calls(b, args))]} for b in args.batches}
        seconds = alternate(workers, works, args.rounds, dict.fromkeys(works, args.repeats), "encoder",
                            0.0 if args.smoke else SAMPLE_S)
    finally:
        _close(workers)
    speed = {e: {k: _items(works[k]) / s for k, s in per.items()} for e, per in seconds.items()}
    return {"texts_per_s": speed, "quality": quality, "check_texts": len(texts)}


CT2_BACKENDS = ("mkl", "onednn")


def bench_translator(env: PeerEnv, work_dir: Path, args: argparse.Namespace,
                     rng: random.Random) -> dict[str, Any]:
    tok = TextTokenizer.from_file(BUILTIN_DIR / "translator-en-es")
    convert(env, "translator", work_dir / "ct2")
    ct2 = work_dir / "ct2"
    workers = {**_ours_workers("translator", args.smoke),
               **{f"ctranslate2 {kind} {backend}": Worker(f"ct2 {kind} {backend}",
                                                          peer(env, "ctranslate2", f"{compute}:{backend}", ct2))
                  for kind, compute in (("fp32", "float32"), ("int8", "int8")) for backend in CT2_BACKENDS}}
    sources = read_sources()
    try:
        ids = tok.encode_batch(sources[: args.check])
        quality = {}
        for beam in (4, 1):
            check = {"kind": "translate", "beam": beam, "batches": _in_batches(ids)}
            outs = {e: [x for part in w.run(check) for x in part] for e, w in workers.items()}
            quality[f"beam {beam}"] = {e: sum(a == b for a, b in zip(outs["ours fp32"], o, strict=True))
                                       for e, o in outs.items()}
        if any(quality[beam][f"ctranslate2 fp32 {b}"] != len(ids) for beam in quality for b in CT2_BACKENDS):
            log.warning("CTranslate2 fp32 differs from ours on some sentences: %s", quality)
        works = {f"{'greedy' if beam == 1 else 'beam 4'}, batch {b}":
                 {"kind": "translate", "beam": beam,
                  "batches": [tok.encode_batch(rng.sample(sources, b)) for _ in range(_calls(b, args))]}
                 for beam in (4, 1) for b in args.batches}
        seconds = alternate(workers, works, args.rounds, dict.fromkeys(works, 1), "translator",
                            0.0 if args.smoke else SAMPLE_S)
    finally:
        _close(workers)
    speed = {e: {k: _items(works[k]) / s for k, s in per.items()} for e, per in seconds.items()}
    backends: dict[str, dict[str, str]] = {}  # CTranslate2 fp32 / int8: its faster backend per work item
    for kind in ("fp32", "int8"):
        name = f"ctranslate2 {kind}"
        backends[name] = {k: max(CT2_BACKENDS, key=lambda b, k=k: speed[f"{name} {b}"][k]) for k in works}
        speed[name] = {k: speed[f"{name} {b}"][k] for k, b in backends[name].items()}
        for b in CT2_BACKENDS:
            quality_b = {beam: per.pop(f"{name} {b}") for beam, per in quality.items()}
            for beam, count in quality_b.items():
                quality[beam][name] = min(count, quality[beam].get(name, count))
    ct2 = {f"{e} {b}": speed.pop(f"{e} {b}") for e in backends for b in CT2_BACKENDS}
    return {"sentences_per_s": speed, "identical": quality, "check_sentences": len(ids),
            "ctranslate2_backends": backends, "ctranslate2_by_backend": ct2}


def llama_bench(env: PeerEnv, gguf: Path, threads: int, prompt: int, new: int) -> dict[str, float]:
    out = subprocess.run([str(env.tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", str(prompt),
                          "-n", str(new), "-r", "1", "-o", "json"], check=True, capture_output=True, text=True)
    rows = json.loads(out.stdout)
    return {("prefill" if r["n_gen"] == 0 else "decode"): r["avg_ts"] for r in rows}


def llama_greedy(env: PeerEnv, gguf: Path, prompt: str, new: int) -> str:
    out = subprocess.run([str(env.tool("llama-simple")), "-m", str(gguf), "-n", str(new), prompt], check=True,
                         capture_output=True, text=True)
    return out.stdout.removeprefix(prompt) if out.stdout.startswith(prompt) else out.stdout


def bench_generator(env: PeerEnv, work_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    (gguf_name,) = zoo.ZOO["smollm2"].files
    q4 = zoo.resolve("smollm2", zoo.default_cache_dir()) / gguf_name
    f32 = f32_gguf(env.tool("llama-quantize"), q4, work_dir / "smollm2.f32.gguf")
    workers = _ours_workers("generator")
    try:
        fp32 = workers["ours fp32"]
        prefill_ids = fp32.run({"kind": "tokenize", "text": " ".join(read_sources())})["ids"][: args.prompt]
        works = {"prefill": {"kind": "prefill", "ids": prefill_ids},
                 "decode": {"kind": "decode", "ids": prefill_ids[:1], "new": args.new}}
        chat = fp32.run({"kind": "tokenize", "messages": CAPITAL})
        prompt_text = chat["text"]
        answers = {e: fp32.run({"kind": "detokenize", "ids": w.run({"kind": "greedy", "ids": chat["ids"], "new": 24})})
                   for e, w in workers.items()}
        answers["llama.cpp F32"] = llama_greedy(env, f32, prompt_text, 24)
        answers["llama.cpp Q4_1"] = llama_greedy(env, q4, prompt_text, 24)
        seconds = {e: {k: [] for k in works} for e in workers}
        peers = {"llama.cpp F32": f32, "llama.cpp Q4_1": q4}
        rates: dict[str, dict[str, list[float]]] = {e: {"prefill": [], "decode": []} for e in peers}
        for w in workers.values():
            for work in works.values():
                w.run(work)
        for r in range(args.rounds):
            for e, w in workers.items():
                for k, work in works.items():
                    time.sleep(SETTLE_S)
                    seconds[e][k].append(w.seconds(work, 1))
            for e, path in peers.items():
                time.sleep(SETTLE_S)
                for k, v in llama_bench(env, path, args.threads, args.prompt, args.new).items():
                    rates[e][k].append(v)
            log.info("generator: round %d/%d done", r + 1, args.rounds)
    finally:
        _close(workers)
    speed = {e: {"prefill": args.prompt / statistics.median(v["prefill"]),
                 "decode": args.new / statistics.median(v["decode"])} for e, v in seconds.items()}
    speed.update({e: {k: statistics.median(v) for k, v in per.items()} for e, per in rates.items()})
    return {"tokens_per_s": speed, "answers": answers, "prompt_tokens": args.prompt, "new_tokens": args.new}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def _float(engine: str) -> bool:
    return engine.split()[-1].split("+")[0] == "fp32"


def _side_by_side(title: str, first: str, speed: dict[str, dict[str, float]], peer: str, name: str, short: str,
                  label: Callable[[str], str] = str) -> list[str]:
    """One table: per work item, every variant of ours and the peer in fp32 and int8, then the best
    float variant of ours against the peer's fp32 and the best quantized one against its int8."""
    mine = [e for e in speed if e.startswith("ours ")]
    head = [e.removeprefix("ours ") for e in mine] + [f"{name} fp32", f"{name} int8"]
    lines = [f"### {title}", "", f"| {first} | " + " | ".join(head) + f" | best float / {short} fp32 | "
             f"best 8-bit / {short} int8 |", "|---|" + "---:|" * (len(head) + 2)]
    for k in speed["ours fp32"]:
        cells = [label(k)] + [f"{speed[e][k]:.1f}" for e in mine + [f"{peer} fp32", f"{peer} int8"]]
        for floats, ref in ((True, f"{peer} fp32"), (False, f"{peer} int8")):
            best = max((e for e in mine if _float(e) == floats), key=lambda e: speed[e][k])
            cells.append(f"{_ratio(speed[best][k], speed[ref][k])} ({best.removeprefix('ours ')})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict[str, Any], command: str) -> str:
    m = result["machine"]
    lines = ["<!-- bench-peers:begin (generated by `python -m loadtests.peers`; a rerun replaces everything up "
             "to the end marker) -->",
             f"## Ours vs the engines users pick (`{command}`, {result['date']})", "",
             f"- **Machine:** {m.get('nproc')} CPUs ({m.get('cpu_model', '?')}; flags "
             f"{', '.join(m.get('cpu_flags', []))}), {m.get('ram_gib', '?')} GiB RAM; {result['threads']} threads "
             "for every engine, each in its own process; engines take turns within each round, medians of "
             f"{result['rounds']} rounds, each round's time the median of as many calls as span {SAMPLE_S} s "
             f"(at most {MAX_REPEATS}).",
             "- **Versions:** " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), ""]
    if "encoder" in result:
        e = result["encoder"]
        s = e["texts_per_s"]
        lines += _side_by_side("MiniLM + sentiment head (texts/s, mixed lengths)", "batch", s, "onnxruntime",
                               "ONNX Runtime", "ORT", label=lambda k: k.split()[1])
        q = e["quality"]
        lines += ["", f"Against ours fp32 on {e['check_texts']} test sentences: " + "; ".join(
            f"{k}: max |Δ embedding| {v['max_abs_diff']:.1e}, same label {v['same_label']:.1%}"
            for k, v in q.items() if k != "ours fp32"), ""]
    if "translator" in result:
        t = result["translator"]
        s = t["sentences_per_s"]
        lines += _side_by_side("Translator en→es (sentences/s)", "work", s, "ctranslate2", "CTranslate2", "CT2")
        n = t["check_sentences"]
        lines += ["", f"Same tokens as ours fp32 on {n} test sentences: " + "; ".join(
            f"{beam}: " + ", ".join(f"{e} {c}/{n}" for e, c in per.items() if e != "ours fp32")
            for beam, per in t["identical"].items()), ""]
        lines += ["CTranslate2 columns: the faster of its two CPU backends (MKL, oneDNN) per work item; by backend: "
                  + "; ".join(f"{e}: " + ", ".join(f"{k} {v:.1f}" for k, v in per.items())
                              for e, per in t.get("ctranslate2_by_backend", {}).items()), ""]
    if "generator" in result:
        g = result["generator"]
        s = g["tokens_per_s"]
        lines += [f"### SmolLM2-135M, batch 1 (tokens/s; prefill {g['prompt_tokens']} tokens, decode "
                  f"{g['new_tokens']} tokens)", "",
                  "| engine | prefill | decode | decode vs llama.cpp F32 | decode vs llama.cpp Q4_1 |",
                  "|---|---:|---:|---:|---:|"]
        for e, v in s.items():
            lines.append(f"| {e} | {v['prefill']:.1f} | {v['decode']:.1f} | "
                         f"{_ratio(v['decode'], s['llama.cpp F32']['decode'])} | "
                         f"{_ratio(v['decode'], s['llama.cpp Q4_1']['decode'])} |")
        lines += ["", "Greedy answer to \"What is the capital of France?\" (24 tokens): " + "; ".join(
            f"{e}: {a.strip()!r}" for e, a in g["answers"].items()), ""]
    lines.append("<!-- bench-peers:end -->")
    return "\n".join(lines) + "\n"


MODELS = ("encoder", "translator", "generator")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="threads for every engine")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    p.add_argument("--smoke", action="store_true", help="seconds: 1 round, batches 1 and 2, no llama.cpp build")
    p.add_argument("--out", type=Path, default=ROOT / ".bench" / "peers")
    p.add_argument("--docs", type=Path, default=None, help="write the tables into this markdown file")
    args = p.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {list(MODELS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.batches = (1, 2) if args.smoke else (1, 8, 32)
    args.rounds = 1 if args.smoke else args.rounds
    args.check, args.repeats = (8, 1) if args.smoke else (96, 3)
    args.min_items = 2 if args.smoke else 16  # a timed item covers at least this many texts
    args.prompt, args.new = (16, 8) if args.smoke else (64, 128)
    os.environ["PEERS_THREADS"] = str(args.threads)
    env = PeerEnv()
    env.ensure_python()
    models = args.models.split(",")
    if "generator" in models and not args.smoke:
        env.ensure_llama()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
                              "threads": args.threads, "rounds": args.rounds, "versions": env.versions()}
    import torch

    result["versions"] = {"torch": torch.__version__, **result["versions"]}
    if "encoder" in models:
        result["encoder"] = bench_encoder(env, args.out, args, rng)
    if "translator" in models:
        result["translator"] = bench_translator(env, args.out, args, rng)
    if "generator" in models and env.has_llama:
        result["generator"] = bench_generator(env, args.out, args)
    elif "generator" in models:
        log.info("generator: llama.cpp is not built (make bench-peers builds it), so no generator table")
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    command = "make bench-peers" + (" (smoke)" if args.smoke else "")
    text = markdown(result, command)
    (args.out / "peers.md").write_text(text)
    print(text)
    if args.docs:
        update_docs(args.docs, text, marker="bench-peers")


if __name__ == "__main__":
    main()
