"""Building and loading models/kernels/: the `torch.ops.ts_panels` kernels, the projections
(panels.cpp) and decode attention over a paged KV cache (attention.cpp).

The sources are compiled once per machine with torch's own extension builder (g++, the headers of the
installed torch) into torch's extension cache ($TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions); a second process, or a restart, loads the cached library in well under a
second, and concurrent first loads wait on torch's build lock instead of compiling twice. The first
build takes about 40 s on 2 cores: `make kernels` (or `python -m models.kernels.native`) builds it
ahead, and the Docker image does so at build time.

`available()` is False, and the callers keep torch's own kernels, when the CPU lacks AVX-512
(F, BW, VL, DQ: torch reports "AVX512"), when TS_NATIVE_KERNELS=0, or when the build fails (no
compiler): each reason is logged once. Where the CPU also has AVX512-VNNI the 8-bit dot products use
it (TS_VNNI; a separate build, so a cache shared between machines never runs it where it is
missing); TS_NATIVE_VNNI=0 builds and runs the AVX512-BW form instead (the same integers: tests
compare the two).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("models.kernels")

SOURCES = [Path(__file__).with_name(name) for name in ("panels.cpp", "attention.cpp")]
NAME = "ts_panels"  # the ops' namespace: torch.ops.ts_panels
DISABLE_ENV = "TS_NATIVE_KERNELS"
VNNI_ENV = "TS_NATIVE_VNNI"
FLAGS = ["-O3", "-fopenmp", "-std=c++17"]


def uses_vnni() -> bool:
    """Whether the build for this CPU uses AVX512-VNNI (the CPU has it and TS_NATIVE_VNNI is not 0)."""
    return bool(torch.cpu.get_capabilities().get("avx512_vnni")) and os.environ.get(VNNI_ENV, "1") != "0"


def cpu_supported() -> bool:
    """AVX-512 with BW/VL/DQ (what the kernels are compiled for), as torch detects it at run time."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernels once per process; True when they can run here."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.info("native kernels off (%s=0)", DISABLE_ENV)
        return False
    if not cpu_supported():
        log.info("native kernels off: the CPU reports %s, they need AVX-512", torch.backends.cpu.get_cpu_capability())
        return False
    from torch.utils.cpp_extension import load

    started = time.perf_counter()
    vnni = uses_vnni()
    try:
        load(name=NAME + ("_vnni" if vnni else "_bw"), sources=[str(source) for source in SOURCES],
             extra_cflags=FLAGS + (["-DTS_VNNI"] if vnni else []), extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: keep torch's kernels, say why
        log.warning("native kernels off: building %s failed (%s)", ", ".join(s.name for s in SOURCES),
                    str(e).splitlines()[-1][:300])
        return False
    _register_fakes()
    log.info("native kernels loaded in %.1f s (8-bit dot products: %s)", time.perf_counter() - started,
             "AVX512-VNNI" if vnni else "AVX512-BW")
    return True


def _register_fakes() -> None:
    """Shapes for torch.compile / meta tensors: each projection maps x (M, K) to (M, n), decode
    attention q (B, H, D) to (B, H, D)."""

    def fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int, *parts: int) -> torch.Tensor:
        return x.new_empty(x.size(0), n)

    for op in ("linear_f32", "linear_q4_1", "linear_q8_0"):
        torch.library.register_fake(f"{NAME}::{op}", fake)

    def fake_attention(q: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.empty_like(q)

    torch.library.register_fake(f"{NAME}::paged_decode_f32", fake_attention)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if available() else 1)
