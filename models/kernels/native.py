"""Building and loading models/kernels/panels.cpp: the `torch.ops.ts_panels` projection kernels.

The source is compiled once per machine with torch's own extension builder (g++, the headers of the
installed torch) into torch's extension cache ($TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions); a second process, or a restart, loads the cached library in well under a
second, and concurrent first loads wait on torch's build lock instead of compiling twice. The first
build takes about 40 s on 2 cores: `make kernels` (or `python -m models.kernels.native`) builds it
ahead, and the Docker image does so at build time.

`available()` is False, and the callers keep torch's own kernels, when the CPU lacks AVX-512
(F, BW, VL, DQ: torch reports "AVX512"), when TS_NATIVE_KERNELS=0, or when the build fails (no
compiler): each reason is logged once.
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

SOURCE = Path(__file__).with_name("panels.cpp")
NAME = "ts_panels"
DISABLE_ENV = "TS_NATIVE_KERNELS"
FLAGS = ["-O3", "-fopenmp", "-std=c++17"]


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
    try:
        load(name=NAME, sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: keep torch's kernels, say why
        log.warning("native kernels off: building %s failed (%s)", SOURCE.name, str(e).splitlines()[-1][:300])
        return False
    _register_fakes()
    log.info("native kernels loaded in %.1f s", time.perf_counter() - started)
    return True


def _register_fakes() -> None:
    """Shapes for torch.compile / meta tensors: each op maps x (M, K) to (M, n)."""

    def fake(x: torch.Tensor, *args: object) -> torch.Tensor:
        return x.new_empty(x.size(0), int(args[-1]))

    for op in ("linear_f32", "linear_q4_1", "linear_q8_0"):
        torch.library.register_fake(f"{NAME}::{op}", fake)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if available() else 1)
