"""bench-peers when a peer fails: a crash, a signal, a non-zero exit, a timeout or output it cannot read
is a failed row that says why, and every other engine and model keeps its figures; llama.cpp's native
build that traps on this machine gives way to one without AMX. Stand-in tools and engine processes
(small scripts) play the peers, so none of this builds llama.cpp or loads a model."""

from __future__ import annotations

import argparse
import json
import random
import stat
import sys
from pathlib import Path

import pytest

from loadtests.peers import bench, env
from loadtests.peers.env import PeerEnv, PeerFailed, llama_builds, llama_rates

AVX512_AMX = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd", "avx512vl", "avx512dq",
              "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}
# llama-bench's JSON for what it is asked (prefill -n 0, decode -p 0, or both: the probe)
LLAMA_BENCH = """#!/bin/sh
case "$*" in *"-p 0 "*) echo '[{"n_prompt": 0, "n_gen": 8, "avg_ts": 100.0}]';;
             *"-n 0 "*) echo '[{"n_prompt": 64, "n_gen": 0, "avg_ts": 500.0}]';;
             *) echo '[{"n_prompt": 64, "n_gen": 0, "avg_ts": 500.0}, {"n_prompt": 0, "n_gen": 4, "avg_ts": 90.0}]';;
esac
"""
# as the Intel Xeon VM's native build ran it: SIGILL in Q4_1 prefill, figures for the rest
TRAPS_IN_Q4_1_PREFILL = LLAMA_BENCH.replace("#!/bin/sh\n", '#!/bin/sh\ncase "$*" in *Q4_1*"-p 64 "*) kill -ILL $$;; esac\n')
TOOLS = {"llama-bench": LLAMA_BENCH, "llama-quantize": '#!/bin/sh\ncp "$2" "$3"\n',
         "llama-simple": '#!/bin/sh\necho "$5 Paris."\n', "llama-server": "#!/bin/sh\n"}
# one of our engines' processes, worker.py's protocol; argv[1] says how it misbehaves, if at all
ENGINE = """import json, os, signal, sys
mode = sys.argv[1]
if mode == "no-start":
    sys.exit(5)
def one(work):
    if work["kind"] == "encode":
        return {"embedding": [[0.5, 0.5] for _ in work["ids"]], "label": [1 for _ in work["ids"]]}
    if work["kind"] == "translate":
        return [[7, 8] for _ in work["ids"]]
    return {"tokenize": {"text": "<chat>", "ids": list(range(100))}, "detokenize": "Paris."}.get(work["kind"], [1, 2])
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if mode == "garbage":
        print("Traceback (most recent call last):", flush=True)
        continue
    if cmd["op"] == "time":
        if mode == "crash-on-time":
            os.kill(os.getpid(), signal.SIGSEGV)
        print(json.dumps({"s": 0.001}), flush=True)
        continue
    work = cmd["work"]
    out = [one({**work, "ids": b}) for b in work["batches"]] if "batches" in work else one(work)
    print(json.dumps({"out": out}), flush=True)
"""


def script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def tools(bin_dir: Path, **override: str) -> Path:
    for name, text in {**TOOLS, **override}.items():
        script(bin_dir / name, text)
    return bin_dir


def engine(tmp_path: Path, mode: str = "ok") -> list[str]:
    return [sys.executable, str(script(tmp_path / "engine.py", ENGINE)), mode]


@pytest.mark.parametrize(("body", "timeout", "why"), [
    ("kill -ILL $$", 30.0, "SIGILL in llama-bench -p 64"),
    ("exit 3", 30.0, "exit 3 in llama-bench -p 64"),
    ("exec sleep 30", 1.0, "timed out after 1 s in llama-bench -p 64"),
    ("echo 'error: unknown model type'", 30.0, "unparseable output of llama-bench -p 64"),
], ids=["signal", "exit", "timeout", "unparseable"])
def test_a_failed_tool_run_says_how(tmp_path: Path, body: str, timeout: float, why: str) -> None:
    bin_dir = tools(tmp_path / "bin", **{"llama-bench": f"#!/bin/sh\n{body}\n"})
    with pytest.raises(PeerFailed) as failed:
        llama_rates(bin_dir, tmp_path / "m.gguf", 2, 64, 0, timeout)
    assert failed.value.why == why


def test_the_generator_keeps_every_other_figure_when_llama_cpp_traps(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    peers = PeerEnv(tmp_path / "peers")
    tools(peers.llama_bin, **{"llama-bench": TRAPS_IN_Q4_1_PREFILL})
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "_ours_argvs", lambda kind, smoke=False: {
        "ours fp32": engine(tmp_path), "ours q4_1+compiled": engine(tmp_path)})
    monkeypatch.setattr("models.zoo.resolve", lambda name, cache_dir: tmp_path / name)
    script(tmp_path / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf", "")
    args = argparse.Namespace(prompt=64, new=8, rounds=2, threads=2)
    result = bench.bench_generator(peers, tmp_path, args)
    assert result["failed"] == {"llama.cpp Q4_1": {"prefill": "SIGILL in llama-bench -p 64"}}
    speed = result["tokens_per_s"]
    assert speed["llama.cpp Q4_1"] == {"decode": 100.0}  # its decode is its own run: kept
    assert speed["llama.cpp F32"] == {"prefill": 500.0, "decode": 100.0}
    assert set(speed["ours fp32"]) == set(speed["ours q4_1+compiled"]) == {"prefill", "decode"}
    assert result["answers"]["llama.cpp Q4_1"].strip() == "Paris." and result["answers"]["ours fp32"] == "Paris."
    text = bench.markdown({"machine": {}, "date": "now", "threads": 2, "rounds": 2, "versions": {},
                           "generator": result}, "a test")
    assert "| llama.cpp Q4_1 | failed | 100.0 | 1.00x | 1.00x |" in text
    assert "llama.cpp Q4_1 prefill: failed (SIGILL in llama-bench -p 64)" in text
    assert "| llama.cpp F32 | 500.0 | 100.0 | 1.00x | 1.00x |" in text


def test_without_a_llama_cpp_build_ours_are_still_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "_ours_argvs", lambda kind, smoke=False: {"ours fp32": engine(tmp_path)})
    monkeypatch.setattr("models.zoo.resolve", lambda name, cache_dir: tmp_path / name)
    args = argparse.Namespace(prompt=64, new=8, rounds=1, threads=2)
    result = bench.bench_generator(PeerEnv(tmp_path / "none"), tmp_path, args, "llama.cpp did not build: cmake")
    assert set(result["tokens_per_s"]["ours fp32"]) == {"prefill", "decode"}
    assert result["failed"]["llama.cpp Q4_1"] == dict.fromkeys(bench.GENERATOR_WORKS, "llama.cpp did not build: cmake")
    assert result["tokens_per_s"]["llama.cpp F32"] == {} and result["answers"]["llama.cpp F32"] is None


def test_an_engine_process_that_fails_is_a_failed_row_and_the_others_are_timed(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    works = {"batch 1": {"kind": "encode", "ids": [[1]]}, "batch 2": {"kind": "encode", "ids": [[1], [2]]}}
    failed: bench.Failures = {}
    workers = bench.start({"ours fp32": engine(tmp_path), "onnxruntime int8": engine(tmp_path, "crash-on-time"),
                           "onnxruntime fp32": engine(tmp_path, "garbage"), "other": engine(tmp_path, "no-start")},
                          failed, works)
    try:
        seconds = bench.alternate(workers, works, 2, dict.fromkeys(works, 1), "test", 0.0, failed)
    finally:
        bench._close(workers)
    assert set(seconds["ours fp32"]) == set(works)
    assert seconds["onnxruntime int8"] == {} and seconds["onnxruntime fp32"] == {}
    assert failed["onnxruntime int8"] == dict.fromkeys(works, "SIGSEGV in onnxruntime int8, batch 1")
    assert failed["onnxruntime fp32"]["batch 2"].startswith("unparseable output of onnxruntime fp32")
    assert failed["other"] == dict.fromkeys(works, "exit 5 in other, starting")
    table = "\n".join(bench._side_by_side("t", "batch", {"ours fp32": seconds["ours fp32"], "onnxruntime fp32": {},
                                                         "onnxruntime int8": {}}, "onnxruntime", "ORT", "ORT",
                                          failed=failed))
    assert "| batch 1 | " in table and table.count("| failed | failed | n/a | n/a |") == 2


SMOKE_ARGS = argparse.Namespace(smoke=True, batches=(1, 2), rounds=1, check=4, repeats=1, min_items=2)


def peers_as(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modes: dict[str, str]) -> None:
    """Our engines and the peers' as stand-in processes, each in modes[its name] ("ok" when not named)."""
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "_ours_argvs", lambda kind, smoke=False: {
        f"ours {m}": engine(tmp_path, modes.get(f"ours {m}", "ok")) for m in ("fp32", "int8")})
    names = {("onnxruntime", "fp32"): "onnxruntime fp32", ("onnxruntime", "int8"): "onnxruntime int8",
             **{("ctranslate2", f"{c}:{b}"): f"ctranslate2 {k} {b}" for k, c in (("fp32", "float32"), ("int8", "int8"))
                for b in bench.CT2_BACKENDS}}
    monkeypatch.setattr(bench, "peer", lambda env, name, mode, path: engine(tmp_path, modes.get(names[name, mode], "ok")))


def test_the_encoder_table_keeps_the_engines_that_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    peers_as(tmp_path, monkeypatch, {"onnxruntime int8": "crash-on-time"})
    monkeypatch.setattr(bench, "convert", lambda env, kind, out: None)
    result = bench.bench_encoder(PeerEnv(tmp_path), tmp_path, SMOKE_ARGS, random.Random(0))
    assert result["failed"] == {"onnxruntime int8": dict.fromkeys(["batch 1", "batch 2"],
                                                                  "SIGSEGV in onnxruntime int8, batch 1")}
    speed = result["texts_per_s"]
    assert list(speed) == ["ours fp32", "ours int8", "onnxruntime fp32", "onnxruntime int8"]
    assert set(speed["onnxruntime fp32"]) == {"batch 1", "batch 2"} and speed["onnxruntime int8"] == {}
    assert result["quality"]["onnxruntime int8"]["same_label"] == 1.0  # its outputs were checked before it died


def test_the_translator_takes_the_ctranslate2_backend_that_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    peers_as(tmp_path, monkeypatch, {"ctranslate2 int8 mkl": "no-start", "ctranslate2 fp32 mkl": "garbage",
                                     "ctranslate2 fp32 onednn": "garbage"})
    monkeypatch.setattr(bench, "convert", lambda env, kind, out: None)
    result = bench.bench_translator(PeerEnv(tmp_path), tmp_path, SMOKE_ARGS, random.Random(0))
    works = ["beam 4, batch 1", "beam 4, batch 2", "greedy, batch 1", "greedy, batch 2"]
    assert result["ctranslate2_backends"]["ctranslate2 int8"] == dict.fromkeys(works, "onednn")
    speed = result["sentences_per_s"]
    assert list(speed) == ["ours fp32", "ours int8", "ctranslate2 fp32", "ctranslate2 int8"]
    assert set(speed["ctranslate2 int8"]) == set(works) and speed["ctranslate2 fp32"] == {}
    assert result["failed"]["ctranslate2 int8 mkl"]["greedy, batch 2"] == "exit 5 in ctranslate2 int8 mkl, starting"
    assert set(result["failed"]["ctranslate2 fp32"]) == set(works)
    assert result["identical"]["beam 4"] == {"ours fp32": 4, "ours int8": 4, "ctranslate2 int8": 4}


def test_a_conversion_that_fails_fails_its_peers_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def conversion_fails(env: PeerEnv, kind: str, out: Path) -> None:
        raise PeerFailed(f"exit 1 in converting the {kind}: KeyError: 'decoder_start_token'")

    peers_as(tmp_path, monkeypatch, {})
    monkeypatch.setattr(bench, "convert", conversion_fails)
    result = bench.bench_translator(PeerEnv(tmp_path), tmp_path, SMOKE_ARGS, random.Random(0))
    assert set(result["sentences_per_s"]["ours int8"]) == {"beam 4, batch 1", "beam 4, batch 2", "greedy, batch 1",
                                                           "greedy, batch 2"}
    assert result["sentences_per_s"]["ctranslate2 fp32"] == {} == result["sentences_per_s"]["ctranslate2 int8"]
    assert result["failed"]["ctranslate2 fp32 mkl"]["beam 4, batch 1"].startswith("exit 1 in converting the translator")


def translator_result() -> dict:
    work = "beam 4, batch 1"
    return {"sentences_per_s": {"ours fp32": {work: 10.0}, "ctranslate2 fp32": {work: 5.0}, "ctranslate2 int8": {}},
            "identical": {"beam 4": {"ours fp32": 8, "ctranslate2 fp32": 8}}, "check_sentences": 8,
            "ctranslate2_by_backend": {"ctranslate2 fp32 mkl": {work: 5.0}},
            "failed": {"ctranslate2 int8": {work: "SIGSEGV in ctranslate2 int8 mkl, beam 4, batch 1"}}}


def test_a_model_that_fails_leaves_the_others_their_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def encoder_fails(*args: object) -> dict:
        raise RuntimeError("ours fp32 failed: SIGKILL in ours fp32, starting")

    monkeypatch.setattr(PeerEnv, "ensure_python", lambda self: None)
    monkeypatch.setattr(PeerEnv, "versions", lambda self: {"ctranslate2": "4.8.5"})
    monkeypatch.setattr(bench, "bench_encoder", encoder_fails)
    monkeypatch.setattr(bench, "bench_translator", lambda *args: translator_result())
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nnot ours to touch\n")
    code = bench.main(["--models", "encoder,translator", "--out", str(tmp_path / "out"), "--docs", str(docs)])
    assert code == 1  # a model without a table: said so, after everything else is written
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["encoder"] == {"error": "RuntimeError: ours fp32 failed: SIGKILL in ours fp32, starting"}
    assert result["translator"]["sentences_per_s"]["ours fp32"] == {"beam 4, batch 1": 10.0}
    text = docs.read_text()
    assert "not ours to touch" in text and text.count("bench-peers:begin") == 1
    assert "No table: RuntimeError: ours fp32 failed" in text
    assert "| beam 4, batch 1 | 10.0 | 5.0 | failed | 2.00x (fp32) | n/a |" in text
    assert "ctranslate2 int8 beam 4, batch 1: failed (SIGSEGV in ctranslate2 int8 mkl, beam 4, batch 1)" in text


def test_a_llama_cpp_build_that_fails_leaves_the_generator_its_other_rows(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def cmake_fails(self: PeerEnv, gguf: Path, threads: int = 2) -> None:
        raise RuntimeError("cmake failed (1); last lines of cmake.log:\n...")

    monkeypatch.setattr(PeerEnv, "ensure_llama", cmake_fails)
    assert bench._build_llama(PeerEnv(tmp_path), 2) == "llama.cpp did not build: cmake failed (1); last lines of " \
        "cmake.log:"


def fake_compile(compiled: list[str], trapping: set[str]):  # noqa: ANN201
    """PeerEnv._compile writing stand-in tools; a build named in `trapping` gets a llama-bench that dies
    of SIGILL, as the native build did on the Intel Xeon VM."""
    def compile_(self: PeerEnv, build: env.LlamaBuild, jobs: int) -> None:
        compiled.append(build.name)
        trap = {"llama-bench": TRAPS_IN_Q4_1_PREFILL} if build.name in trapping else {}
        tools(self.root / build.folder / "bin", **trap)
    return compile_


def test_a_native_build_that_traps_gives_way_to_one_without_amx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    monkeypatch.setattr(env, "cpu_flags", lambda: AVX512_AMX)
    monkeypatch.setattr(PeerEnv, "_compile", fake_compile(compiled, {"native"}))
    peers = PeerEnv(tmp_path / "peers")
    choice = peers.ensure_llama(tmp_path / "smollm2.Q4_1.gguf")
    assert compiled == ["native", "no-AMX"]
    assert choice == {"build": "no-AMX", "folder": "llama-build-noamx",
                      "rejected": {"native": "SIGILL in llama-bench -p 64 -n 4"}}
    # what tool() runs from now on, in this process or another (llama_server's launcher)
    assert PeerEnv(peers.root).tool("llama-bench") == peers.root / "llama-build-noamx" / "bin" / "llama-bench"
    assert PeerEnv(peers.root).has_llama
    assert peers.llama_version().endswith(", no-AMX build (native build: SIGILL in llama-bench -p 64 -n 4)")
    peers.ensure_llama(tmp_path / "smollm2.Q4_1.gguf")
    assert compiled == ["native", "no-AMX"]  # built once: a rerun probes again, builds nothing


def test_a_native_build_that_runs_is_the_one_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    monkeypatch.setattr(env, "cpu_flags", lambda: AVX512_AMX)
    monkeypatch.setattr(PeerEnv, "_compile", fake_compile(compiled, set()))
    peers = PeerEnv(tmp_path / "peers")
    assert peers.ensure_llama(tmp_path / "smollm2.Q4_1.gguf") == {"build": "native", "folder": "llama-build", "rejected": {}}
    assert compiled == ["native"] and peers.tool("llama-bench") == peers.root / "llama-build" / "bin" / "llama-bench"


def test_when_every_build_traps_the_last_is_used_and_its_runs_fail_as_rows(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    monkeypatch.setattr(env, "cpu_flags", lambda: AVX512_AMX)
    monkeypatch.setattr(PeerEnv, "_compile", fake_compile(compiled, {"native", "no-AMX", "AVX2"}))
    choice = PeerEnv(tmp_path / "peers").ensure_llama(tmp_path / "smollm2.Q4_1.gguf")
    assert compiled == ["native", "no-AMX", "AVX2"] and choice["build"] == "AVX2"
    assert set(choice["rejected"]) == {"native", "no-AMX", "AVX2"}


def test_the_fallback_builds_name_the_cpus_instruction_sets_without_amx() -> None:
    native, no_amx, avx2 = llama_builds(AVX512_AMX)
    assert native.options == ("-DGGML_NATIVE=ON",)
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON",
            "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF"} <= set(no_amx.options)
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF"} <= set(avx2.options)
    # a CPU without AVX-512: the two fallbacks are one build
    assert [b.name for b in llama_builds({"avx", "avx2", "fma", "f16c"})] == ["native", "no-AMX"]
