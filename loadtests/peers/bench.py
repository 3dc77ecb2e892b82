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

A peer's run that fails (a crash or signal, a non-zero exit, a timeout, output it cannot read, a
conversion or build that fails) is a "failed" cell of its table and a line saying why
("llama.cpp Q4_1 prefill: failed (SIGILL in llama-bench -p 64)"); every other engine and model is
measured, printed and written as usual. A model that gives no table at all (ours fails) is said so in
its place and makes the exit status 1, after everything else is written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from loadtests.models.bench import mixed_texts
from models import zoo
from models.catalog import BUILTIN_DIR
from models.machine import machine_info
from models.text import TextTokenizer

from ..report import update_docs
from .convert import f32_gguf
from .env import ROOT, PeerEnv, PeerFailed, exit_reason, llama_rates, run_tool

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
# our variants per model (worker.py modes, models.spec.variant): float ones (fp32, and bf16: our
# bfloat16 panels, where the CPU has AVX512-BF16) face the peer's fp32, the rest its int8; "+a8": the
# block formats with 8-bit activations, llama.cpp's arithmetic; "+bf16p": a generator's prompts on
# bfloat16 panels (the translator's compiled blocks measured slower than eager: its per-step cost is
# outside them)
OURS = {"encoder": ("fp32", "fp32+compiled", "bf16", "int8", "q8_0+compiled", "q8_0+a8+compiled"),
        "translator": ("fp32", "bf16", "int8", "q8_0", "q8_0+a8"),
        "generator": ("fp32", "fp32+compiled", "q4_1+compiled", "q4_1+bf16p+compiled", "q4_1+a8+compiled")}
# --smoke: one float, one int8 and one block variant each, none compiled (each compile is its own
# process's tens of seconds on 2 cores; tests/models/test_compiled.py covers compiled blocks)
SMOKE = {"encoder": ("fp32", "int8", "q8_0+a8"), "translator": ("fp32", "int8", "q8_0+a8")}
# one call to an engine's process (its start loads, and may compile, its model), one llama.cpp tool's run
CALL_TIMEOUT_S = 900.0
LLAMA_TIMEOUT_S = 600.0
LLAMA_PEERS = ("llama.cpp F32", "llama.cpp Q4_1")
GENERATOR_WORKS = ("prefill", "decode", "answer")
# engine -> work item -> why it gave no figure ("SIGILL in llama-bench -p 64"); in each model's results
Failures = dict[str, dict[str, str]]


def _ours_argvs(kind: str, smoke: bool = False) -> dict[str, list[str]]:
    """Our variants of `kind` as worker command lines; the bfloat16 ones only where our panels run."""
    from models.kernels import native

    bf16 = native.has_bf16()
    return {f"ours {m}": ours(kind, m) for m in (SMOKE if smoke else OURS)[kind] if bf16 or "bf16" not in m}


@dataclass
class Worker:
    """An engine in its own process, driven over stdin/stdout (worker.py). A call (the start included)
    whose process dies, runs past `timeout` s or answers other than one JSON line raises PeerFailed,
    which says how ("SIGSEGV in onnxruntime int8"); the process is then gone."""

    name: str
    argv: list[str]
    timeout: float = CALL_TIMEOUT_S
    proc: subprocess.Popen = field(init=False)

    def __post_init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=ROOT, env=env)
        self._read()

    def _read(self) -> dict[str, Any]:
        late = threading.Event()
        timer = threading.Timer(self.timeout, lambda: (late.set(), self.proc.kill()))
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            code = self.proc.wait()
            how = f"timed out after {self.timeout:.0f} s" if late.is_set() else exit_reason(code)
            raise PeerFailed(f"{how} in {self.name}")
        try:
            return json.loads(line)
        except ValueError:
            self.proc.kill()
            raise PeerFailed(f"unparseable output of {self.name}: {line[:60]!r}") from None

    def call(self, **cmd: Any) -> dict[str, Any]:
        with contextlib.suppress(OSError):  # when it is gone, _read says how
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        return self._read()

    def run(self, work: dict[str, Any]) -> Any:
        return self.call(op="run", work=work)["out"]

    def seconds(self, work: dict[str, Any], repeats: int) -> float:
        return self.call(op="time", work=work, repeats=repeats)["s"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def _fail(failed: Failures, engine: str, keys: Iterable[str], why: str) -> None:
    """Record `engine` as failed, for `why`, on each of `keys` that has no failure yet."""
    log.warning("%s: failed (%s)", engine, why)
    per = failed.setdefault(engine, {})
    for k in keys:
        per.setdefault(k, why)


def _guard(failed: Failures, engine: str, keys: Iterable[str], what: str, run: Callable[[], Any]) -> Any:
    """run()'s value, or None when it raises PeerFailed: `engine` is then failed on `keys` (all its work
    items for a process that died, the one item for a tool's run), `what` added to the why."""
    try:
        return run()
    except PeerFailed as e:
        _fail(failed, engine, keys, f"{e.why}, {what}" if what else e.why)
        return None


def start(argvs: dict[str, list[str]], failed: Failures, keys: Iterable[str]) -> dict[str, Worker]:
    """A Worker per engine; one whose process does not come up is failed on every one of `keys` instead."""
    workers = {}
    for e, argv in argvs.items():
        w = _guard(failed, e, keys, "starting", lambda e=e, argv=argv: Worker(e, argv))
        if w is not None:
            workers[e] = w
    return workers


def run_all(workers: dict[str, Worker], work: dict[str, Any], failed: Failures, keys: Iterable[str],
            what: str) -> dict[str, Any]:
    """Each engine's outputs for `work`, those failed already skipped; one that fails now is failed on `keys`."""
    outs = {}
    for e, w in workers.items():
        if e not in failed:
            out = _guard(failed, e, keys, what, lambda w=w: w.run(work))
            if e not in failed:
                outs[e] = out
    return outs


def _reference(found: dict[str, Any], failed: Failures) -> Any:
    """found["ours fp32"] (its outputs, its worker): what every engine is checked against; RuntimeError
    (the model gets no table) when it failed."""
    if "ours fp32" not in found:
        raise RuntimeError(f"ours fp32 failed: {next(iter(failed.get('ours fp32', {}).values()), 'no output')}")
    return found["ours fp32"]


def alternate(workers: dict[str, Worker], works: dict[str, dict[str, Any]], rounds: int,
              repeats: dict[str, int], label: str, sample_s: float = SAMPLE_S,
              failed: Failures | None = None) -> dict[str, dict[str, float]]:
    """Median seconds per (engine, work): a warm-up call each (timed), then rounds in which the engines
    take turns, each sample the median of at least repeats[work] calls, and of as many as span
    `sample_s` by the warm-up's time (at most MAX_REPEATS). An engine failed already is skipped; one
    that fails now is failed on every work item in `failed` and left out of the rest, its figures empty."""
    failed = {} if failed is None else failed
    live = {e: w for e, w in workers.items() if e not in failed}

    def timed(e: str, k: str, repeats: int) -> float | None:
        s = _guard(failed, e, works, k, lambda: live[e].seconds(works[k], repeats))
        if s is None:
            live.pop(e)
        return s

    calls: dict[str, dict[str, int]] = {e: {} for e in live}
    for e in list(live):
        for k in works:
            once = timed(e, k, 1) if e in live else None
            if once is not None:
                calls[e][k] = max(repeats[k], min(MAX_REPEATS, math.ceil(sample_s / max(once, 1e-6))))
    samples: dict[str, dict[str, list[float]]] = {e: {k: [] for k in works} for e in live}
    for r in range(rounds):
        start_s = time.monotonic()
        for k in works:
            for e in list(live):
                time.sleep(SETTLE_S)
                s = timed(e, k, calls[e][k])
                if s is not None:
                    samples[e][k].append(s)
        log.info("%s: round %d/%d done in %.0f s", label, r + 1, rounds, time.monotonic() - start_s)
    return {e: {k: statistics.median(v) for k, v in samples[e].items()} if e in live else {} for e in workers}


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
    """Our `kind` converted for its peer into `out`; PeerFailed ("exit 1 in converting the encoder: ...")
    when the conversion fails, its stderr's end logged."""
    log.info("converting our %s for its peer into %s", kind, out)
    done = subprocess.run([str(env.python), "-m", "loadtests.peers.convert", kind, str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode:
        log.warning("converting the %s failed:\n%s", kind, done.stderr[-4000:])
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise PeerFailed(f"{exit_reason(done.returncode)} in converting the {kind}: {last[:120]}")


def convert_or_fail(env: PeerEnv, kind: str, out: Path, failed: Failures, engines: Iterable[str],
                    keys: Iterable[str]) -> None:
    """convert(), a failure of which fails the peer's `engines` on every one of `keys`."""
    try:
        convert(env, kind, out)
    except PeerFailed as e:
        for engine in engines:
            _fail(failed, engine, keys, e.why)


def bench_encoder(env: PeerEnv, work_dir: Path, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    tok = TextTokenizer.from_file(zoo.resolve("minilm", zoo.default_cache_dir()))
    works = {f"batch {b}": {"kind": "encode", "batches": [tok.encode_batch(mixed_texts(b, rng))
                                                           for _ in range(_calls(b, args))]} for b in args.batches}
    failed: Failures = {}
    onnx = {"onnxruntime fp32": ("fp32", "encoder.onnx"), "onnxruntime int8": ("int8", "encoder.int8.onnx")}
    convert_or_fail(env, "encoder", work_dir / "onnx", failed, onnx, works)
    argvs = {**_ours_argvs("encoder", args.smoke),
             **{e: peer(env, "onnxruntime", mode, work_dir / "onnx" / name) for e, (mode, name) in onnx.items()}}
    workers = start({e: a for e, a in argvs.items() if e not in failed}, failed, works)
    try:
        texts = read_sources()[: args.check]
        check = {"kind": "encode", "batches": _in_batches(tok.encode_batch(texts))}
        outs = {e: {k: [x for part in parts for x in part[k]] for k in ("embedding", "label")}
                for e, parts in run_all(workers, check, failed, works, "checking outputs").items()}
        ref = _reference(outs, failed)
        quality = {}
        for e, o in outs.items():
            diff = max(abs(a - b) for u, v in zip(ref["embedding"], o["embedding"], strict=True)
                       for a, b in zip(u, v, strict=True))
            same = sum(a == b for a, b in zip(ref["label"], o["label"], strict=True)) / len(texts)
            quality[e] = {"max_abs_diff": diff, "same_label": same}
        if quality.get("onnxruntime fp32", {"max_abs_diff": 0.0})["max_abs_diff"] > 1e-5:
            raise RuntimeError(f"ONNX export differs from our encoder: {quality['onnxruntime fp32']}")
        seconds = alternate(workers, works, args.rounds, dict.fromkeys(works, args.repeats), "encoder",
                            0.0 if args.smoke else SAMPLE_S, failed)
    finally:
        _close(workers)
    speed = {e: {k: _items(works[k]) / s for k, s in seconds.get(e, {}).items()} for e in argvs}
    return {"texts_per_s": speed, "quality": quality, "check_texts": len(texts), "failed": failed}


CT2_BACKENDS = ("mkl", "onednn")


def bench_translator(env: PeerEnv, work_dir: Path, args: argparse.Namespace,
                     rng: random.Random) -> dict[str, Any]:
    tok = TextTokenizer.from_file(BUILTIN_DIR / "translator-en-es")
    sources = read_sources()
    works = {f"{'greedy' if beam == 1 else 'beam 4'}, batch {b}":
             {"kind": "translate", "beam": beam,
              "batches": [tok.encode_batch(rng.sample(sources, b)) for _ in range(_calls(b, args))]}
             for beam in (4, 1) for b in args.batches}
    failed: Failures = {}
    ct2 = work_dir / "ct2"
    peers = {f"ctranslate2 {kind} {backend}": f"{compute}:{backend}"
             for kind, compute in (("fp32", "float32"), ("int8", "int8")) for backend in CT2_BACKENDS}
    convert_or_fail(env, "translator", ct2, failed, peers, works)
    argvs = {**_ours_argvs("translator", args.smoke),
             **{e: peer(env, "ctranslate2", mode, ct2) for e, mode in peers.items()}}
    workers = start({e: a for e, a in argvs.items() if e not in failed}, failed, works)
    try:
        ids = tok.encode_batch(sources[: args.check])
        quality = {}
        for beam in (4, 1):
            check = {"kind": "translate", "beam": beam, "batches": _in_batches(ids)}
            outs = {e: [x for part in parts for x in part]
                    for e, parts in run_all(workers, check, failed, works, f"checking beam {beam}").items()}
            ref = _reference(outs, failed)
            quality[f"beam {beam}"] = {e: sum(a == b for a, b in zip(ref, o, strict=True)) for e, o in outs.items()}
        if any(quality[beam].get(f"ctranslate2 fp32 {b}", len(ids)) != len(ids) for beam in quality
               for b in CT2_BACKENDS):
            log.warning("CTranslate2 fp32 differs from ours on some sentences: %s", quality)
        seconds = alternate(workers, works, args.rounds, dict.fromkeys(works, 1), "translator",
                            0.0 if args.smoke else SAMPLE_S, failed)
    finally:
        _close(workers)
    speed = {e: {k: _items(works[k]) / s for k, s in seconds.get(e, {}).items()} for e in argvs}
    backends = _best_backends(speed, quality, failed, works)
    by_backend = {f"{e} {b}": speed.pop(f"{e} {b}") for e in backends for b in CT2_BACKENDS}
    return {"sentences_per_s": speed, "identical": quality, "check_sentences": len(ids),
            "ctranslate2_backends": backends, "ctranslate2_by_backend": by_backend, "failed": failed}


def _best_backends(speed: dict[str, dict[str, float]], quality: dict[str, dict[str, int]], failed: Failures,
                   works: Iterable[str]) -> dict[str, dict[str, str]]:
    """CTranslate2 fp32 / int8 as one engine each in `speed` and `quality`: per work item its faster
    backend that ran (failed when neither did), the fewer identical sentences of the two; returns
    the backend chosen per work item."""
    backends: dict[str, dict[str, str]] = {}
    for kind in ("fp32", "int8"):
        name = f"ctranslate2 {kind}"
        backends[name], speed[name] = {}, {}
        for k in works:
            ran = [b for b in CT2_BACKENDS if k in speed[f"{name} {b}"]]
            if ran:
                backends[name][k] = max(ran, key=lambda b, k=k: speed[f"{name} {b}"][k])
                speed[name][k] = speed[f"{name} {backends[name][k]}"][k]
            else:
                failed.setdefault(name, {})[k] = "; ".join(failed[f"{name} {b}"][k] for b in CT2_BACKENDS)
        for per in quality.values():
            counts = [per.pop(f"{name} {b}") for b in CT2_BACKENDS if f"{name} {b}" in per]
            if counts:
                per[name] = min(counts)
    return backends


def llama_bench(env: PeerEnv, gguf: Path, threads: int, work: str, n: int) -> float:
    """llama.cpp's tokens/s for one work item, "prefill" of `n` tokens or "decode" of `n`, each its own
    llama-bench run (a crash in one leaves the other); PeerFailed when it gives none."""
    prompt, new = (n, 0) if work == "prefill" else (0, n)
    return llama_rates(env.llama_bin, gguf, threads, prompt, new, LLAMA_TIMEOUT_S)[work]


def llama_greedy(env: PeerEnv, gguf: Path, prompt: str, new: int) -> str:
    out = run_tool([str(env.tool("llama-simple")), "-m", str(gguf), "-n", str(new), prompt], "llama-simple",
                   LLAMA_TIMEOUT_S)
    return out.removeprefix(prompt)


def llama_files(env: PeerEnv, q4: Path, work_dir: Path, failed: Failures, build_error: str | None) -> dict[str, Path]:
    """The GGUF of each llama.cpp engine, the F32 one converted by its llama-quantize; an engine without
    one (build_error: llama.cpp did not build) is failed on every work item instead."""
    if build_error:
        for e in LLAMA_PEERS:
            _fail(failed, e, GENERATOR_WORKS, build_error)
        return {}
    f32 = _guard(failed, "llama.cpp F32", GENERATOR_WORKS, "",
                 lambda: f32_gguf(env.tool("llama-quantize"), q4, work_dir / "smollm2.f32.gguf"))
    return {e: path for e, path in (("llama.cpp F32", f32), ("llama.cpp Q4_1", q4)) if path is not None}


def bench_generator(env: PeerEnv, work_dir: Path, args: argparse.Namespace,
                    build_error: str | None = None) -> dict[str, Any]:
    """Ours and llama.cpp on SmolLM2: greedy answers, prefill and decode tokens/s. A llama.cpp run that
    fails is that engine's failed work item, the rounds going on without it; one of our processes
    that fails is failed on every item and left out."""
    (gguf_name,) = zoo.ZOO["smollm2"].files
    q4 = zoo.resolve("smollm2", zoo.default_cache_dir()) / gguf_name
    failed: Failures = {}
    peers = llama_files(env, q4, work_dir, failed, build_error)
    workers = start(_ours_argvs("generator"), failed, GENERATOR_WORKS)
    live = dict(workers)

    def ours_call(e: str, what: str, run: Callable[[Worker], Any]) -> Any:
        out = _guard(failed, e, GENERATOR_WORKS, what, lambda: run(live[e]))
        if e in failed:
            live.pop(e)
        return out

    try:
        fp32 = _reference(workers, failed)
        prefill_ids = fp32.run({"kind": "tokenize", "text": " ".join(read_sources())})["ids"][: args.prompt]
        works = {"prefill": {"kind": "prefill", "ids": prefill_ids},
                 "decode": {"kind": "decode", "ids": prefill_ids[:1], "new": args.new}}
        chat = fp32.run({"kind": "tokenize", "messages": CAPITAL})
        answers: dict[str, str | None] = {}
        for e in workers:
            ids = ours_call(e, "greedy answer", lambda w: w.run({"kind": "greedy", "ids": chat["ids"], "new": 24}))
            answers[e] = None if ids is None else fp32.run({"kind": "detokenize", "ids": ids})
        for e in LLAMA_PEERS:
            answers[e] = None if e not in peers else _guard(
                failed, e, ["answer"], "", partial(llama_greedy, env, peers[e], chat["text"], 24))
        for e in list(live):
            ours_call(e, "warm-up", lambda w: [w.run(work) for work in works.values()])
        seconds = {e: {k: [] for k in works} for e in workers}
        rates: dict[str, dict[str, list[float]]] = {e: {k: [] for k in works} for e in LLAMA_PEERS}
        for r in range(args.rounds):
            for e in list(live):
                for k, work in works.items():
                    time.sleep(SETTLE_S)
                    s = ours_call(e, k, lambda w, work=work: w.seconds(work, 1)) if e in live else None
                    if s is not None:
                        seconds[e][k].append(s)
            for e, path in peers.items():
                for k in works:
                    if k in failed.get(e, {}):
                        continue
                    time.sleep(SETTLE_S)
                    n = args.prompt if k == "prefill" else args.new
                    rate = _guard(failed, e, [k], "", partial(llama_bench, env, path, args.threads, k, n))
                    if rate is not None:
                        rates[e][k].append(rate)
            log.info("generator: round %d/%d done", r + 1, args.rounds)
    finally:
        _close(workers)
    tokens = {"prefill": args.prompt, "decode": args.new}
    speed = {e: {k: tokens[k] / statistics.median(v) for k, v in per.items() if e in live and v}
             for e, per in seconds.items()}
    speed.update({e: {k: statistics.median(v) for k, v in per.items() if v and k not in failed.get(e, {})}
                  for e, per in rates.items()})
    return {"tokens_per_s": speed, "answers": answers, "prompt_tokens": args.prompt, "new_tokens": args.new,
            "failed": failed}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def _vs(per: dict[str, float], ref: dict[str, float], k: str) -> str:
    return _ratio(per[k], ref[k]) if k in per and k in ref else "n/a"


def _cell(per: dict[str, float], k: str) -> str:
    return f"{per[k]:.1f}" if k in per else "failed"


def _float(engine: str) -> bool:
    return engine.split()[-1].split("+")[0] in ("fp32", "bf16")


def failure_lines(failed: Failures) -> list[str]:
    """One entry per engine and reason: "llama.cpp Q4_1 prefill: failed (SIGILL in llama-bench -p 64)"."""
    lines = []
    for e, per in failed.items():
        by_why: dict[str, list[str]] = {}
        for k, why in per.items():
            by_why.setdefault(why, []).append(k)
        lines += [f"{e} {', '.join(keys)}: failed ({why})" for why, keys in by_why.items()]
    return lines


def _failures(section: dict[str, Any]) -> list[str]:
    lines = failure_lines(section.get("failed", {}))
    return ["", "Failed runs (no figure): " + "; ".join(lines) + "."] if lines else []


def _side_by_side(title: str, first: str, speed: dict[str, dict[str, float]], peer: str, name: str, short: str,
                  label: Callable[[str], str] = str, failed: Failures | None = None) -> list[str]:
    """One table: per work item, every variant of ours and the peer in fp32 and int8, then the best
    float variant of ours against the peer's fp32 and the best quantized one against its int8; a run
    that failed reads "failed", a ratio without its two figures "n/a"."""
    mine = [e for e in speed if e.startswith("ours ")]
    head = [e.removeprefix("ours ") for e in mine] + [f"{name} fp32", f"{name} int8"]
    lines = [f"### {title}", "", f"| {first} | " + " | ".join(head) + f" | best float / {short} fp32 | "
             f"best 8-bit / {short} int8 |", "|---|" + "---:|" * (len(head) + 2)]
    works = dict.fromkeys(k for per in [*speed.values(), *(failed or {}).values()] for k in per)
    for k in works:
        cells = [label(k)] + [_cell(speed.get(e, {}), k) for e in mine + [f"{peer} fp32", f"{peer} int8"]]
        for floats, ref in ((True, f"{peer} fp32"), (False, f"{peer} int8")):
            best = max((e for e in mine if _float(e) == floats and k in speed[e]), key=lambda e: speed[e][k],
                       default=None)
            vs = _vs(speed[best], speed.get(ref, {}), k) if best else "n/a"
            cells.append(f"{vs} ({best.removeprefix('ours ')})" if vs != "n/a" else vs)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _encoder_lines(e: dict[str, Any]) -> list[str]:
    lines = _side_by_side(TITLES["encoder"], "batch", e["texts_per_s"], "onnxruntime", "ONNX Runtime", "ORT",
                          label=lambda k: k.split()[1], failed=e.get("failed")) + _failures(e)
    return lines + ["", f"Against ours fp32 on {e['check_texts']} test sentences: " + "; ".join(
        f"{k}: max |Δ embedding| {v['max_abs_diff']:.1e}, same label {v['same_label']:.1%}"
        for k, v in e["quality"].items() if k != "ours fp32"), ""]


def _translator_lines(t: dict[str, Any]) -> list[str]:
    lines = _side_by_side(TITLES["translator"], "work", t["sentences_per_s"], "ctranslate2", "CTranslate2", "CT2",
                          failed=t.get("failed")) + _failures(t)
    n = t["check_sentences"]
    lines += ["", f"Same tokens as ours fp32 on {n} test sentences: " + "; ".join(
        f"{beam}: " + ", ".join(f"{e} {c}/{n}" for e, c in per.items() if e != "ours fp32")
        for beam, per in t["identical"].items()), ""]
    return lines + ["CTranslate2 columns: the faster of its two CPU backends (MKL, oneDNN) per work item; by "
                    "backend: " + "; ".join(f"{e}: " + (", ".join(f"{k} {v:.1f}" for k, v in per.items()) or "failed")
                                            for e, per in t.get("ctranslate2_by_backend", {}).items()), ""]


def _generator_lines(g: dict[str, Any]) -> list[str]:
    s = g["tokens_per_s"]
    f32, q4 = (s.get(e, {}) for e in LLAMA_PEERS)
    lines = [f"### SmolLM2-135M, batch 1 (tokens/s; prefill {g['prompt_tokens']} tokens, decode "
             f"{g['new_tokens']} tokens)", "",
             "| engine | prefill | decode | decode vs llama.cpp F32 | decode vs llama.cpp Q4_1 |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {e} | {_cell(v, 'prefill')} | {_cell(v, 'decode')} | {_vs(v, f32, 'decode')} | "
              f"{_vs(v, q4, 'decode')} |" for e, v in s.items()]
    return lines + _failures(g) + ["", "Greedy answer to \"What is the capital of France?\" (24 tokens): " + "; ".join(
        f"{e}: {a.strip()!r}" if a is not None else f"{e}: failed" for e, a in g["answers"].items()), ""]


TITLES = {"encoder": "MiniLM + sentiment head (texts/s, mixed lengths)", "translator": "Translator en→es (sentences/s)",
          "generator": "SmolLM2-135M, batch 1 (tokens/s)"}
TABLES = {"encoder": _encoder_lines, "translator": _translator_lines, "generator": _generator_lines}


def markdown(result: dict[str, Any], command: str) -> str:
    """The docs block: machine, versions, then each model's table in MODELS order (a model whose run
    raised: its error in the table's place)."""
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
    for model in (m for m in MODELS if m in result):
        if "error" in result[model]:
            lines += [f"### {TITLES[model]}", "", f"No table: {result[model]['error']}", ""]
        else:
            lines += TABLES[model](result[model])
    lines.append("<!-- bench-peers:end -->")
    return "\n".join(lines) + "\n"


MODELS = ("encoder", "translator", "generator")


def _section(model: str, bench: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """bench()'s results, or {"error": why} when it raised: the other models are measured regardless."""
    try:
        return bench()
    except Exception as e:  # any failure of one model's run must leave the others their tables
        log.exception("%s: no table", model)
        return {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}


def _build_llama(env: PeerEnv, threads: int) -> str | None:
    """None when llama.cpp is built and one of its builds passes its probe (env.ensure_llama), else why not."""
    (gguf_name,) = zoo.ZOO["smollm2"].files
    try:
        env.ensure_llama(zoo.resolve("smollm2", zoo.default_cache_dir()) / gguf_name, threads)
    except Exception as e:  # no llama.cpp: its rows say why, the other engines still run
        log.exception("llama.cpp did not build")
        return f"llama.cpp did not build: {(str(e).strip().splitlines() or [type(e).__name__])[0][:300]}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Measure, print, write results.json / peers.md (and --docs); 1 when a model got no table, else 0."""
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
    models = [m for m in MODELS if m in args.models.split(",")]
    if "generator" in models and args.smoke:
        log.info("generator: not part of --smoke (it would build llama.cpp), so no generator table")
        models.remove("generator")
    build_error = _build_llama(env, args.threads) if "generator" in models else None
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
                              "threads": args.threads, "rounds": args.rounds, "versions": env.versions()}
    import torch

    result["versions"] = {"torch": torch.__version__, **result["versions"]}
    benches = {"encoder": lambda: bench_encoder(env, args.out, args, rng),
               "translator": lambda: bench_translator(env, args.out, args, rng),
               "generator": lambda: bench_generator(env, args.out, args, build_error)}
    for model in models:
        result[model] = _section(model, benches[model])
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    command = "make bench-peers" + (" (smoke)" if args.smoke else "")
    text = markdown(result, command)
    (args.out / "peers.md").write_text(text)
    print(text)
    if args.docs:
        update_docs(args.docs, text, marker="bench-peers")
    for model in models:
        for line in failure_lines(result[model].get("failed", {})):
            log.warning("%s: %s", model, line)
    errors = [m for m in models if "error" in result[m]]
    if errors:
        log.error("no table for %s (the log above says why); the other tables are written", ", ".join(errors))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
