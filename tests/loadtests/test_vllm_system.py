"""The vllm_cpu bench-serve system: what it serves, how it starts, and how to get it (its own venv)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.peers import vllm
from loadtests.systems import launchers
from loadtests.systems.launchers import LaunchConfig, vllm_cpu


def config(tmp_path: Path, tasks: tuple[str, ...] = ("classify", "generate"), dtype: str = "auto") -> LaunchConfig:
    return LaunchConfig(tasks, "default", 8124, 1, "cpu", tmp_path, dtype=dtype)


def test_without_its_venv_it_says_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm.VllmEnv, "__init__", lambda self: object.__setattr__(self, "root", tmp_path / "none"))
    launch = vllm_cpu(config(tmp_path))
    assert launch.tasks == () and launch.skipped["classify"] == "vLLM serves generation only here"
    assert "make peers-vllm" in launch.skipped["generate"]


def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    venv = tmp_path / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".peers-installed").write_text(vllm.VLLM)
    model = tmp_path / "smollm2-hf"
    monkeypatch.setattr(vllm.VllmEnv, "__init__", lambda self: object.__setattr__(self, "root", tmp_path))
    monkeypatch.setattr(vllm.VllmEnv, "ensure_model", lambda self, cache_dir=None: model)
    return model


@pytest.mark.parametrize(("dtype", "want"), [("auto", "float32"), ("bfloat16", "bfloat16")])
def test_with_its_venv_it_serves_smollm2_from_the_gguf_in_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  dtype: str, want: str) -> None:
    model = installed(tmp_path, monkeypatch)
    monkeypatch.setattr(vllm, "tcmalloc", lambda: Path("/lib/libtcmalloc_minimal.so.4"))
    launch = vllm_cpu(config(tmp_path, dtype=dtype))
    argv = launch.argv
    assert launch.tasks == ("generate",) and launch.ready_path == "/health" and launch.openapi is None
    assert argv[0] == str(tmp_path / "vllm-venv" / "bin" / "python")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(model) and argv[argv.index("--dtype") + 1] == want
    assert argv[argv.index("--port") + 1] == "8124" and argv[argv.index("--max-num-seqs") + 1] == "128"
    assert launch.env["OMP_NUM_THREADS"] == "1" and launch.env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4"
    assert launchers.SYSTEMS["vllm_cpu"] is vllm_cpu


def test_other_model_sets_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    installed(tmp_path, monkeypatch)
    launch = vllm_cpu(LaunchConfig(("generate",), "tiny", 8124, 1, "cpu", tmp_path))
    assert launch.tasks == () and "default SmolLM2" in launch.skipped["generate"]


def test_tcmalloc_is_found_where_debian_puts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "libtcmalloc_minimal.so.4").write_text("")
    monkeypatch.setattr(vllm, "TCMALLOC_DIRS", (tmp_path / "missing", tmp_path))
    assert vllm.tcmalloc() == tmp_path / "libtcmalloc_minimal.so.4"
