"""Building and loading models/kernels/: the `torch.ops.ts_panels` ops (projections, panels.cpp; paged
decode attention, attention.cpp; paged prompt attention, prompt_attention.cpp; a beam step's candidates,
select.cpp) and the build's Python module
(module.cpp: a whole stack's decode step or encoder pass, block_step.cpp; copying pool blocks, pool.cpp).

`available()` builds once per machine, instruction set and checkout (torch's extension builder, cached
under $TORCH_EXTENSIONS_DIR: `build_directory()`; concurrent first loads wait on one another, and a
build killed midway leaves no lock that would hold the next load forever; `python -m
models.kernels.native` builds ahead) and loads once per process; it is False, and callers keep
torch's kernels, with no AVX2/FMA/F16C or AVX-512, with TS_NATIVE_KERNELS=0, or when the build fails
(`unavailable_reason`).
`isa()` picks the widest build the CPU runs (TS_NATIVE_ISA may pick a narrower one); every build
computes the same bits. `module()` only after available() said True.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger("models.kernels")

SOURCES = [Path(__file__).with_name(name)
           for name in ("panels.cpp", "attention.cpp", "prompt_attention.cpp", "block_step.cpp", "lora.cpp",
                        "select.cpp", "pool.cpp", "module.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "ops.h")]
NAME = "ts_panels"  # the ops' namespace: torch.ops.ts_panels
DISABLE_ENV = "TS_NATIVE_KERNELS"
ISA_ENV = "TS_NATIVE_ISA"
FLAGS = ["-O3", "-fopenmp", "-std=c++17"]
# widest first: each build's name suffix and the defines that select its width in simd.h
ISAS = {"avx512_bf16": ["-DTS_VNNI", "-DTS_BF16"], "avx512_vnni": ["-DTS_VNNI"], "avx512": [], "avx2": ["-DTS_AVX2"]}


def cpu_isas() -> list[str]:
    """The builds this CPU can run (widest first), as torch detects its features at run time."""
    caps = torch.cpu.get_capabilities()
    avx512 = all(caps.get(f"avx512_{x}") for x in ("f", "bw", "vl", "dq"))
    vnni = avx512 and caps.get("avx512_vnni")
    return (["avx512_bf16"] if vnni and caps.get("avx512_bf16") else []) + (["avx512_vnni"] if vnni else []) + (
        ["avx512"] if avx512 else []) + (["avx2"] if caps.get("avx2") and caps.get("fma3") and caps.get("f16c") else [])


def has_bf16() -> bool:
    """Whether the loaded build has the bfloat16 panels (linear_bf16: CPUs with AVX512-BF16)."""
    return available() and isa() == "avx512_bf16"


def isa() -> str | None:
    """The build this process uses: the widest the CPU runs, or TS_NATIVE_ISA's if it runs that; None: none."""
    runs = cpu_isas()
    wanted = os.environ.get(ISA_ENV, "")
    if wanted:
        if wanted not in ISAS:
            raise ValueError(f"{ISA_ENV}={wanted!r}: expected one of {', '.join(ISAS)}")
        return wanted if wanted in runs else None
    return runs[0] if runs else None


def _build_flags(chosen: str) -> list[str]:
    # torch rebuilds when a source or a flag changes; the header's hash in a define covers simd.h
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    return FLAGS + ISAS[chosen] + [f"-DTS_HEADERS_SHA={digest}"]


_module: list = []  # the build's Python module (module.cpp), once loaded
_off: list[str] = []  # why available() said False, once it has


def unavailable_reason() -> str:
    """Why available() is False (after calling it), for a plan's reasons; "" where the kernels run."""
    return "" if available() else (_off[-1] if _off else "not loaded in this process")


def module():  # noqa: ANN201 - the extension module's type exists only once it is built
    """The build's Python module (module.cpp: the stack step); only after available() said True."""
    if not available():
        raise RuntimeError("the native kernels are not loaded here")
    return _module[0]


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernels once per process; True when they can run here."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        _off.append(f"{DISABLE_ENV}=0")
        log.info("native kernels off (%s=0)", DISABLE_ENV)
        return False
    chosen = isa()
    if chosen is None:
        _off.append(f"the CPU reports {torch.backends.cpu.get_cpu_capability()}; they need AVX2 with FMA and F16C, "
                    "or AVX-512")
        log.info("native kernels off: the CPU reports %s; they need AVX2 with FMA and F16C, or AVX-512%s",
                 torch.backends.cpu.get_cpu_capability(),
                 f" ({ISA_ENV}={os.environ[ISA_ENV]})" if os.environ.get(ISA_ENV) else "")
        return False
    from torch.utils.cpp_extension import load

    started = time.perf_counter()
    try:
        folder = build_directory(chosen)
        with _build_lock(folder):
            _module.append(load(name=f"{NAME}_{chosen}", sources=[str(source) for source in SOURCES],
                                extra_cflags=_build_flags(chosen), extra_ldflags=["-fopenmp"],
                                build_directory=str(folder), is_python_module=True, verbose=False))
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: keep torch's kernels, say why
        _off.append(f"building them failed: {str(e).splitlines()[-1][:200]}")
        log.warning("native kernels off: building %s failed (%s)", ", ".join(s.name for s in SOURCES),
                    str(e).splitlines()[-1][:300])
        return False
    _register_fakes()
    log.info("native kernels loaded in %.1f s (%s)", time.perf_counter() - started, chosen)
    return True


def build_directory(chosen: str) -> Path:
    """The folder of `chosen`'s build: in torch's extensions folder, one per instruction set and per
    checkout of these sources (a build names its sources by path, so two checkouts sharing a folder
    would rebuild at every switch from one to the other); created if missing."""
    from torch.utils.cpp_extension import _get_build_directory

    checkout = hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:12]
    folder = Path(_get_build_directory(f"{NAME}_{chosen}", verbose=False)) / checkout
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Held around torch's build and load in `folder`. Torch's own lock is a file its holder removes,
    so a process killed while building (SIGKILL, out of memory, a replica stopped mid-start) leaves it
    and every later load waits on it forever. Ours is an flock, which the kernel drops with its holder:
    whoever holds it is the only one of our loads at work, so a torch lock file found then is stale."""
    with open(folder / "ts-build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        stale = folder / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


def _register_fakes() -> None:
    """Shapes for torch.compile / meta tensors: each projection maps x (M, K) to (M, n), decode
    attention q (B, H, D) to (B, H, D), prompt attention q (B, H, T, D) to a (B, H, T, D) view of (B, T, H, D)."""

    def fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int, *parts: int) -> torch.Tensor:
        return x.new_empty(x.size(0), n)

    for op in ("linear_f32", "linear_q4_1", "linear_q8_0"):
        torch.library.register_fake(f"{NAME}::{op}", fake)

    def fake_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return x.new_empty(x.size(0), n, dtype=torch.float32)

    torch.library.register_fake(f"{NAME}::linear_bf16", fake_bf16)

    def fake_attention(q: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.empty_like(q)

    torch.library.register_fake(f"{NAME}::paged_decode", fake_attention)

    def fake_prompt(q: torch.Tensor, *args: object) -> torch.Tensor:
        b, h, t, d = q.shape
        return q.new_empty(b, t, h, d).permute(0, 2, 1, 3)  # (B, H, T, D) view of (B, T, H, D)

    torch.library.register_fake(f"{NAME}::paged_prompt", fake_prompt)

    def fake_lora_(*args: object) -> None:
        return None

    torch.library.register_fake(f"{NAME}::lora_update_", fake_lora_)



if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if available() else 1)
