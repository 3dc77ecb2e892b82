"""The peers' own environment under .peers/: a virtualenv for CTranslate2 and ONNX Runtime, and
llama.cpp built from the source vendored in the pinned llama-cpp-python sdist.

The virtualenv reaches the service's packages (torch, transformers, our code) through a .pth file,
so conversions can read our models, while the peers' wheels stay out of the service's venv.

llama.cpp is built natively first (-march=native); a build whose tools fail a short probe on the
GGUF (e.g. SIGILL: a VM that advertises instructions it traps, AMX on an Intel Xeon VM) gives way to
one with the instruction sets named explicitly and AMX off (llama_builds). The build in use is
recorded in .peers/llama-build.json, which tool() follows, and reported in versions().
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import site as sitelib
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.peers")

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / ".peers"
# Pinned peers: the versions the figures came from; a change here re-creates the env.
PIP_PEERS = ("ctranslate2==4.8.5", "onnxruntime==1.32.0", "onnx==1.23.2")
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_TOOLS = ("llama-bench", "llama-quantize", "llama-simple", "llama-server")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF")
LLAMA_CHOICE = "llama-build.json"  # under .peers/: the build in use, and why the ones before it were not
# ggml's x86 options for a build without -march=native, each with the /proc/cpuinfo flags it needs
X86_OPTIONS = {"GGML_SSE42": ("sse4_2",), "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_FMA": ("fma",),
               "GGML_F16C": ("f16c",), "GGML_BMI2": ("bmi2",), "GGML_AVX_VNNI": ("avx_vnni",),
               "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
               "GGML_AVX512_VBMI": ("avx512vbmi",), "GGML_AVX512_VNNI": ("avx512_vnni",),
               "GGML_AVX512_BF16": ("avx512_bf16",)}
NO_AMX = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
PROBE_TIMEOUT_S = 120.0
PROBE_PROMPT = 64  # the benchmark's prefill: the batched Q4_1 work that trapped


class PeerFailed(RuntimeError):
    """A peer's run that gave no result; `why` says how, e.g. "SIGILL in llama-bench -p 64"."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def exit_reason(returncode: int) -> str:
    """How a process ended: a signal's name for a negative return code ("SIGILL"), else "exit 3"."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def run_tool(argv: list[str], label: str, timeout: float) -> str:
    """The tool's stdout; PeerFailed naming `label` and how it failed (signal, exit status, timeout,
    not runnable) otherwise, its last stderr lines logged."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerFailed(f"timed out after {timeout:.0f} s in {label}") from None
    except OSError as e:
        raise PeerFailed(f"{e.strerror or e} in {label}") from None
    if done.returncode:
        why = f"{exit_reason(done.returncode)} in {label}"
        log.warning("%s%s", why, "".join(f"\n  {line}" for line in done.stderr.splitlines()[-10:]))
        raise PeerFailed(why)
    return done.stdout


def llama_rates(bin_dir: Path, gguf: Path, threads: int, prompt: int, new: int,
                timeout: float = 600.0) -> dict[str, float]:
    """llama-bench's tokens/s over one repetition: "prefill" of `prompt` tokens and "decode" of `new`,
    each only when asked for (> 0); PeerFailed ("SIGILL in llama-bench -p 64") when it gives them not."""
    label = "llama-bench" + (f" -p {prompt}" if prompt else "") + (f" -n {new}" if new else "")
    out = run_tool([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt),
                    "-n", str(new), "-r", "1", "-o", "json"], label, timeout)
    try:
        rates = {("prefill" if r["n_gen"] == 0 else "decode"): float(r["avg_ts"]) for r in json.loads(out)}
    except (ValueError, TypeError, KeyError):
        rates = {}
    if set(rates) != {k for k, n in (("prefill", prompt), ("decode", new)) if n}:
        raise PeerFailed(f"unparseable output of {label}")
    return rates


def probe_llama(bin_dir: Path, gguf: Path, threads: int = 2) -> str | None:
    """None when the tools in `bin_dir` run the benchmark's kinds of work on `gguf` (a 64-token
    prefill, a few decode steps, a short greedy answer), else why not ("SIGILL in llama-bench -p 64 -n 4")."""
    try:
        llama_rates(bin_dir, gguf, threads, PROBE_PROMPT, 4, PROBE_TIMEOUT_S)
        run_tool([str(bin_dir / "llama-simple"), "-m", str(gguf), "-n", "4", "Hello"], "llama-simple",
                 PROBE_TIMEOUT_S)
    except PeerFailed as e:
        return e.why
    return None


@dataclass(frozen=True)
class LlamaBuild:
    """One way to build llama.cpp: its name in the results, its folder under .peers/, its cmake options."""

    name: str
    folder: str
    options: tuple[str, ...]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    found = re.search(r"^flags\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.is_file() else None
    return set(found.group(1).split()) if found else set()


def _explicit(flags: set[str], avx512: bool) -> tuple[str, ...]:
    """GGML_NATIVE off, each x86 option on where the CPU has its flags (AVX-512 ones only if `avx512`), AMX off."""
    on = [opt for opt, need in X86_OPTIONS.items() if set(need) <= flags and (avx512 or "AVX512" not in opt)]
    return ("-DGGML_NATIVE=OFF", *(f"-D{opt}={'ON' if opt in on else 'OFF'}" for opt in X86_OPTIONS), *NO_AMX)


def llama_builds(flags: set[str]) -> tuple[LlamaBuild, ...]:
    """The builds to try, in order: native (-march=native: everything the CPU says it has, AMX
    included), then without AMX (the CPU's AVX2 / AVX-512 sets named one by one), then without AVX-512;
    a build the same as the one before it is left out."""
    builds = [LlamaBuild("native", "llama-build", ("-DGGML_NATIVE=ON",)),
              LlamaBuild("no-AMX", "llama-build-noamx", _explicit(flags, avx512=True)),
              LlamaBuild("AVX2", "llama-build-avx2", _explicit(flags, avx512=False))]
    return tuple(b for i, b in enumerate(builds) if i == 0 or b.options != builds[i - 1].options)


@dataclass(frozen=True)
class PeerEnv:
    root: Path = PEERS_DIR

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def llama_choice(self) -> dict[str, Any]:
        """The build in use ({"build", "folder", "rejected": {build: why}}): ensure_llama's last choice,
        the native build before any."""
        path = self.root / LLAMA_CHOICE
        if path.is_file():
            return json.loads(path.read_text())
        return {"build": "native", "folder": "llama-build", "rejected": {}}

    @property
    def llama_bin(self) -> Path:
        return self.root / self.llama_choice["folder"] / "bin"

    def tool(self, name: str) -> Path:
        return self.llama_bin / name

    @property
    def has_llama(self) -> bool:
        return all(self.tool(t).is_file() for t in LLAMA_TOOLS)

    def _run(self, cmd: list[str], logfile: Path | None = None, **kw) -> None:
        log.info("$ %s", " ".join(map(str, cmd)))
        if logfile is None:
            subprocess.run(cmd, check=True, **kw)
            return
        with logfile.open("w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)
        if proc.returncode:
            raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}); last lines of {logfile}:\n"
                               + "\n".join(logfile.read_text().splitlines()[-20:]))

    def ensure_python(self) -> None:
        """A venv with the pinned peer wheels that sees the service venv's packages through a .pth."""
        stamp = self.root / "venv" / ".peers-installed"
        if stamp.is_file() and stamp.read_text() == "\n".join(PIP_PEERS):
            return
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.python.exists():
            self._run([_base_python(), "-m", "venv", str(self.root / "venv")])
        site = subprocess.run([str(self.python), "-c", "import site; print(site.getsitepackages()[0])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        Path(site, "transformer-serve.pth").write_text(f"{sitelib.getsitepackages()[0]}\n{ROOT}\n")
        self._run([str(self.python), "-m", "pip", "install", "-q", *PIP_PEERS])
        stamp.write_text("\n".join(PIP_PEERS))

    def ensure_llama(self, gguf: Path, threads: int = 2, jobs: int = 2) -> dict[str, Any]:
        """The first of llama_builds() whose tools pass probe_llama on `gguf`, each built when missing
        (cmake, CPU, Release: ~10 min), recorded for tool() and returned (llama_choice); the last one
        when none passes, its runs then failing as rows of the results. RuntimeError when one does not build."""
        builds = llama_builds(cpu_flags())
        rejected: dict[str, str] = {}
        for build in builds:
            bin_dir = self.root / build.folder / "bin"
            if not all((bin_dir / t).is_file() for t in LLAMA_TOOLS):
                self._compile(build, jobs)
            why = probe_llama(bin_dir, gguf, threads)
            if why is None:
                break
            rejected[build.name] = why
            log.warning("llama.cpp's %s build fails on this machine (%s)%s", build.name, why,
                        "" if build is builds[-1] else "; trying the next build")
        choice = {"build": build.name, "folder": build.folder, "rejected": rejected}
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / LLAMA_CHOICE).write_text(json.dumps(choice))
        return choice

    def _compile(self, build: LlamaBuild, jobs: int) -> None:
        """llama.cpp's tools from the sdist's vendor/llama.cpp into build.folder, with build.options."""
        if not shutil.which("cmake"):
            raise RuntimeError("building llama.cpp needs cmake (apt-get install cmake g++)")
        src = self._llama_source()
        out = self.root / build.folder
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        start = time.monotonic()
        log.info("building llama.cpp (%s) from %s (a few minutes; log in %s)", build.name, src, self.root / "build.log")
        self._run(["cmake", "-S", str(src), "-B", str(out), *gen, *CMAKE_FLAGS, *build.options], self.root / "cmake.log")
        self._run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *LLAMA_TOOLS], self.root / "build.log")
        log.info("llama.cpp (%s) built in %.0f s", build.name, time.monotonic() - start)

    def _llama_source(self) -> Path:
        name = LLAMA_CPP_PYTHON.replace("-", "_").replace("==", "-")
        src = self.root / name / "vendor" / "llama.cpp"
        if src.is_dir():
            return src
        self.root.mkdir(parents=True, exist_ok=True)
        self._run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                   LLAMA_CPP_PYTHON, "-d", str(self.root)])
        with tarfile.open(self.root / f"{name}.tar.gz") as tar:
            tar.extractall(self.root, filter="data")
        return src

    def llama_commit(self) -> str:
        head = self.root / LLAMA_CPP_PYTHON.replace("-", "_").replace("==", "-") / ".git" / "modules" / "vendor" / \
            "llama.cpp" / "HEAD"
        return head.read_text().strip() if head.is_file() else "unknown"

    def versions(self) -> dict[str, str]:
        code = ("import json, ctranslate2, onnxruntime, onnx; print(json.dumps({'ctranslate2': ctranslate2.__version__,"
                " 'onnxruntime': onnxruntime.__version__, 'onnx': onnx.__version__}))")
        out = json.loads(subprocess.run([str(self.python), "-c", code], check=True, capture_output=True,
                                        text=True).stdout)
        out["llama.cpp"] = self.llama_version() if self.has_llama else "not built"
        return out

    def llama_version(self) -> str:
        """The sdist, its llama.cpp commit and the build in use, with why the builds before it were not used."""
        choice = self.llama_choice
        rejected = "; ".join(f"{name} build: {why}" for name, why in choice["rejected"].items())
        return (f"{LLAMA_CPP_PYTHON} sdist, commit {self.llama_commit()}, {choice['build']} build"
                + (f" ({rejected})" if rejected else ""))


def _base_python() -> str:
    """The interpreter the service venv was made from (a venv made from a venv would not see it)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))
