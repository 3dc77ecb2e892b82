"""Loading the native kernels' build (models/kernels/native.py): a lock file that torch's builder left
behind when its process was killed does not hold the next load forever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models.kernels import native

ROOT = Path(__file__).resolve().parents[3]


def test_a_lock_left_by_a_killed_build_is_removed_and_the_build_loads(tmp_path: Path) -> None:
    # CI sets REQUIRE_NATIVE_KERNELS=1 (.ci/run): there a missing build fails instead of skipping
    if not native.available() and not os.environ.get("REQUIRE_NATIVE_KERNELS"):
        pytest.skip(f"no AVX2 or AVX-512 CPU, or no compiler, for the native kernels: {native.unavailable_reason()}")
    built = native.build_directory(native.isa())
    root = tmp_path / "extensions"
    # this process's build, copied with its times (nothing to rebuild) where a process with
    # TORCH_EXTENSIONS_DIR=root looks for it, and the lock file of a builder killed midway (torch's: a
    # file its holder removes when it finishes)
    copy = root / built.relative_to(built.parents[1])  # (TORCH_EXTENSIONS_DIR has no python/cpu level)
    shutil.copytree(built, copy, symlinks=True, ignore=shutil.ignore_patterns("lock", "*.flock"))
    (copy / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), native.ISA_ENV: native.isa(), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(); "
                           "from models.kernels import native; print(native.available(), native.build_directory("
                           "native.isa()))"], env=env, capture_output=True, text=True, timeout=240)
    assert done.stdout.strip().splitlines()[-1] == f"True {copy}", done.stderr[-2000:]
    assert "left by a build that was killed" in done.stderr and not (copy / "lock").exists()


def test_each_checkout_builds_in_a_folder_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two checkouts of these sources never share a build folder (torch's build names its sources by
    path: sharing one, each would rebuild after the other loaded); one checkout always finds its own."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = native.build_directory("avx2")
    assert here == native.build_directory("avx2") and here.is_dir()
    assert here.parent == tmp_path / f"{native.NAME}_avx2"
    monkeypatch.setattr(native, "__file__", "/elsewhere/models/kernels/native.py")
    there = native.build_directory("avx2")
    assert there.parent == here.parent and there != here
