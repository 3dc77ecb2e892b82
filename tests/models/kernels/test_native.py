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
    if not native.available():
        pytest.skip(f"the native kernels do not run here: {native.unavailable_reason()}")
    from torch.utils.cpp_extension import _get_build_directory

    name = f"{native.NAME}_{native.isa()}"
    built = Path(_get_build_directory(name, verbose=False))
    root = tmp_path / "extensions"
    # this process's build, copied with its times (nothing to rebuild), and the lock file of a builder
    # killed midway (torch's: a file its holder removes when it finishes)
    shutil.copytree(built, root / name, symlinks=True, ignore=shutil.ignore_patterns("lock", "*.flock"))
    (root / name / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), native.ISA_ENV: native.isa(), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(); "
                           "from models.kernels import native; print(native.available())"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.stdout.strip().splitlines()[-1] == "True", done.stderr[-2000:]
    assert "left by a build of" in done.stderr and not (root / name / "lock").exists()
