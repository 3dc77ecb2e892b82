"""The llama_server bench-serve system: what it serves, how it starts, and its generation route (it
publishes no OpenAPI document, so the launcher gives one the benchmark reads like any other)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.protocol import discover_generate
from loadtests.systems import launchers
from loadtests.systems.launchers import LLAMA_SERVER_OPENAPI, LaunchConfig, llama_server


def config(tmp_path: Path, tasks: tuple[str, ...] = ("classify", "generate")) -> LaunchConfig:
    return LaunchConfig(tasks, "default", 8123, 2, "cpu", tmp_path)


def test_its_route_is_openai_completions_with_exact_lengths() -> None:
    api, note = discover_generate(LLAMA_SERVER_OPENAPI)
    assert api is not None and api.path == "/v1/completions", note
    assert (api.prompt_field, api.max_field, api.exact_field, api.can_stream) == ("prompt", "max_tokens",
                                                                                   "ignore_eos", True)
    body = api.request("hello", 7, stream=True, exact=True).body
    assert body == {"prompt": "hello", "max_tokens": 7, "stream": True, "ignore_eos": True, "temperature": 0.0}


def test_without_a_build_it_says_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loadtests.peers import env

    monkeypatch.setattr(env, "PEERS_DIR", tmp_path / "none")
    monkeypatch.setattr(env.PeerEnv, "__init__", lambda self: object.__setattr__(self, "root", tmp_path / "none"))
    launch = llama_server(config(tmp_path))
    assert launch.tasks == () and launch.skipped["classify"] == "llama-server serves generation only"
    assert "make bench-peers" in launch.skipped["generate"]


def test_with_a_build_it_serves_the_pinned_gguf_on_32_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loadtests.peers import env

    tool = tmp_path / "llama-build" / "bin" / "llama-server"
    tool.parent.mkdir(parents=True)
    tool.write_text("")
    monkeypatch.setattr(env.PeerEnv, "__init__", lambda self: object.__setattr__(self, "root", tmp_path))
    monkeypatch.setattr("models.zoo.resolve", lambda name, cache_dir: tmp_path / name)
    launch = llama_server(config(tmp_path))
    assert launch.tasks == ("generate",) and launch.ready_path == "/health" and launch.openapi is LLAMA_SERVER_OPENAPI
    argv = launch.argv
    assert argv[0] == str(tool) and argv[argv.index("-np") + 1] == "32" and "-cb" in argv
    assert argv[argv.index("-m") + 1].startswith(str(tmp_path / "smollm2")) and argv[argv.index("-t") + 1] == "2"
    assert launchers.SYSTEMS["llama_server"] is llama_server
