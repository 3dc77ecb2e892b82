"""docker-compose.yml (and the GPU override) as Debian's `docker-compose config` resolves them: the
services, their ports, healthchecks and the mounted monitoring files. No Docker engine is needed.

Without docker-compose these tests skip, unless REQUIRE_DOCKER_COMPOSE=1 (.ci/run sets it), where
they fail."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.serve_configs import GPU_CONFIG

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"


def _compose_binary() -> str:
    found = shutil.which("docker-compose")
    if found is None:
        message = "docker-compose is not installed (Debian: apt-get install docker-compose)"
        if os.environ.get("REQUIRE_DOCKER_COMPOSE") == "1":
            pytest.fail(f"{message}, and REQUIRE_DOCKER_COMPOSE=1 requires it")
        pytest.skip(message)
    return found


def resolved(*files: Path) -> dict[str, Any]:
    """`docker-compose -f ... config`: the merged, validated, normalised file (host paths made absolute)."""
    cmd = [_compose_binary(), "--project-directory", str(ROOT)]
    for f in files:
        cmd += ["-f", str(f)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    done = subprocess.run([*cmd, "config"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
                          check=False)
    assert done.returncode == 0, f"docker-compose config failed:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return resolved(COMPOSE)


def _ports(service: dict[str, Any]) -> set[tuple[int, int]]:
    return {(int(p["published"]), int(p["target"])) for p in service["ports"]}


def _binds(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path of each bind mount (short syntax: host:container[:mode])."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("/"):
            out[target] = Path(source)
    return out


def _healthcheck(service: dict[str, Any]) -> str:
    hc = service["healthcheck"]
    assert hc["test"][0] == "CMD" and re.fullmatch(r"\d+s", hc["interval"]) and int(hc["retries"]) >= 1
    return " ".join(hc["test"][1:])


def test_the_three_services(config: dict[str, Any]) -> None:
    assert set(config["services"]) == {"serve", "prometheus", "grafana"}
    assert set(config["volumes"]) == {"prometheus-data", "grafana-data"}


def test_serve_is_built_from_our_dockerfile(config: dict[str, Any]) -> None:
    serve = config["services"]["serve"]
    build = serve["build"]
    assert Path(build["context"]) == ROOT and (ROOT / build["dockerfile"]) == ROOT / "deploy" / "Dockerfile"
    assert build["args"] == {"VARIANT": "cpu"}
    assert _ports(serve) == {(8000, 8000)}
    assert "http://127.0.0.1:8000/healthz" in _healthcheck(serve)
    assert serve["shm_size"] in ("2gb", 2 << 30)


def test_prometheus_mounts_our_config_and_rules(config: dict[str, Any]) -> None:
    prom = config["services"]["prometheus"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prom["image"])  # pinned, never :latest
    assert _ports(prom) == {(9090, 9090)}
    binds = _binds(prom)
    assert binds["/etc/prometheus/prometheus.yml"] == ROOT / "deploy/prometheus/prometheus.yml"
    assert binds["/etc/prometheus/alerts.yml"] == ROOT / "deploy/prometheus/alerts.yml"
    for host in binds.values():
        assert host.is_file(), f"{host} is mounted but missing from the repository"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert "/-/ready" in _healthcheck(prom)
    prom_config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = [t for job in prom_config["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]]
    assert "serve:8000" in targets  # the compose service name and port
    rule_files = [str(Path("/etc/prometheus") / r) for r in prom_config.get("rule_files", [])]
    assert rule_files and set(rule_files) <= set(binds), f"rule files {rule_files} are not all mounted"


def test_grafana_is_provisioned_from_the_repository(config: dict[str, Any]) -> None:
    grafana = config["services"]["grafana"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])
    assert _ports(grafana) == {(3000, 3000)}
    binds = _binds(grafana)
    assert binds["/etc/grafana/provisioning"] == ROOT / "deploy/grafana/provisioning"
    assert binds["/var/lib/grafana/dashboards"] == ROOT / "deploy/grafana/dashboards"
    for host in binds.values():
        assert host.is_dir(), f"{host} is mounted but missing from the repository"
    assert any((ROOT / "deploy/grafana/dashboards").glob("*.json")), "no dashboard to provision"
    assert "/api/health" in _healthcheck(grafana)
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_started"}}
    # the provisioning reaches Prometheus by its compose name, and reads the dashboards where they are mounted
    provisioning = ROOT / "deploy/grafana/provisioning"
    sources = [s for f in sorted((provisioning / "datasources").glob("*.y*ml"))
               for s in yaml.safe_load(f.read_text())["datasources"]]
    prom_port = _ports(config["services"]["prometheus"]).pop()[1]
    assert any(s["type"] == "prometheus" and s["url"] == f"http://prometheus:{prom_port}" for s in sources)
    providers = [p for f in sorted((provisioning / "dashboards").glob("*.y*ml"))
                 for p in yaml.safe_load(f.read_text())["providers"]]
    assert "/var/lib/grafana/dashboards" in {p["options"]["path"] for p in providers}


def test_gpu_override_builds_the_cuda_image_and_reserves_a_gpu() -> None:
    serve = resolved(COMPOSE, GPU_OVERRIDE)["services"]["serve"]
    assert serve["build"]["args"] == {"VARIANT": "cuda"} and serve["image"].endswith("-cuda")
    (device,) = serve["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and int(device["count"]) >= 1
    argv = serve["command"]
    assert argv[:3] == ["python", "-m", "service"]
    assert ROOT / argv[argv.index("--config") + 1] == GPU_CONFIG
    assert _ports(serve) == {(8000, 8000)}  # the rest comes from the base file


def test_a_broken_file_fails_validation(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  serve:\n    image: x\n    ports: 8000\n    helthcheck: {}\n")
    done = subprocess.run([_compose_binary(), "-f", str(broken), "config"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode != 0 and "helthcheck" in done.stderr
