"""The peers' own environment under .peers/: a virtualenv for CTranslate2 and ONNX Runtime, and
llama.cpp built from the source vendored in the pinned llama-cpp-python sdist.

The virtualenv reaches the service's packages (torch, transformers, our code) through a .pth file,
so conversions can read our models, while the peers' wheels stay out of the service's venv.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import site as sitelib
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("bench.peers")

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / ".peers"
# Pinned peers: the versions the figures came from; a change here re-creates the env.
PIP_PEERS = ("ctranslate2==4.8.5", "onnxruntime==1.32.0", "onnx==1.23.2")
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_TOOLS = ("llama-bench", "llama-quantize", "llama-simple", "llama-server")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF")


@dataclass(frozen=True)
class PeerEnv:
    root: Path = PEERS_DIR

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def llama_bin(self) -> Path:
        return self.root / "llama-build" / "bin"

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

    def ensure_llama(self, jobs: int = 2) -> None:
        """llama.cpp's tools built from the sdist's vendor/llama.cpp (cmake, CPU, Release): ~10 min."""
        if self.has_llama:
            return
        if not shutil.which("cmake"):
            raise RuntimeError("building llama.cpp needs cmake (apt-get install cmake g++)")
        src = self._llama_source()
        build = self.root / "llama-build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        start = time.monotonic()
        log.info("building llama.cpp from %s (a few minutes; log in %s)", src, self.root / "build.log")
        self._run(["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS], self.root / "cmake.log")
        self._run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *LLAMA_TOOLS], self.root / "build.log")
        log.info("llama.cpp built in %.0f s", time.monotonic() - start)

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
        out["llama.cpp"] = f"{LLAMA_CPP_PYTHON} sdist, commit {self.llama_commit()}" if self.has_llama else "not built"
        return out


def _base_python() -> str:
    """The interpreter the service venv was made from (a venv made from a venv would not see it)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))
