"""`python -m service` before it starts Ray: the weights check and the CPUs it asks Ray for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.__main__ import cpus_needed, main, missing_weights
from service.settings import Settings

TINY = {"name": "tiny", "tasks": ["embed"], "source": "tiny:encoder"}


def test_missing_weights_names_the_deployment_and_source(tmp_path: Path) -> None:
    args = {"cache_dir": str(tmp_path), "deployments": {
        "enc": {"model": TINY},
        "mine": {"model": {**TINY, "name": "mine", "source": f"dir:{tmp_path / 'nowhere'}"}},
    }}
    problems = missing_weights(Settings.build(args, env={}))
    assert len(problems) == 1 and problems[0].startswith(f"mine (mine): dir:{tmp_path / 'nowhere'}")


def test_cpus_needed_counts_replicas() -> None:
    args = {"ingress": {"num_cpus": 0.5}, "deployments": {
        "a": {"model": TINY, "num_cpus": 2, "num_replicas": 2},
        "b": {"model": {**TINY, "name": "b"}, "num_cpus": 1,
              "autoscaling_config": {"min_replicas": 3, "max_replicas": 5}},
    }}
    assert cpus_needed(Settings.build(args, env={})) == 0.5 + 4 + 3


def test_main_refuses_to_start_without_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "applications:\n  - import_path: service.app:build_app\n    args:\n"
        f"      cache_dir: {tmp_path}\n      deployments:\n        enc:\n          model:\n"
        f"            {{name: x, tasks: [embed], source: 'dir:{tmp_path / 'absent'}'}}\n")
    for key in [k for k in os.environ if k.startswith("TS_")]:
        monkeypatch.delenv(key)
    assert main(["--config", str(config)]) == 1


def test_missing_weights_checks_a_pinned_gguf(tmp_path: Path) -> None:
    gen = {"name": "gen", "tasks": ["generate"], "source": "gguf:zoo:smollm2"}
    problems = missing_weights(Settings.build({"cache_dir": str(tmp_path), "deployments": {"gen": {"model": gen}}},
                                              env={}))
    assert len(problems) == 1 and problems[0].startswith("gen (gen): gguf:zoo:smollm2: ") and "fetch" in problems[0]


def test_a_deployment_that_cannot_start_is_named_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """When serve.run fails, `python -m service` logs each failed deployment's error (its last line: a
    PlanError naming the backend the machine lacks), not only Serve's "Failed to update"."""
    from types import SimpleNamespace

    from ray import serve

    from service import __main__ as main

    failed = SimpleNamespace(status="DEPLOY_FAILED", message="The deployment failed to start 3 times in a row.\n"
                             "Traceback ...\nmodels.execution.plan.PlanError: decode on cuda_graphs: needs a CUDA device")
    fine = SimpleNamespace(status="HEALTHY", message="")
    apps = {"transformer-serve": SimpleNamespace(deployments={"generator": failed, "encoder": fine})}
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications=apps))
    assert main._failed_deployments() == [
        ("generator", "models.execution.plan.PlanError: decode on cuda_graphs: needs a CUDA device")]
