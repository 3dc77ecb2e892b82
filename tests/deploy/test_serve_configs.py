"""deploy/serve_config.yaml and its GPU variant: valid for Ray Serve and for our Settings, autoscaled,
and the same service apart from placement and sizes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from ray.serve.config import AutoscalingConfig

from service.deployments import deployment_options
from service.fleet.autoscaling import LoadPolicy
from tests.deploy.serve_configs import CPU_CONFIG, GPU_CONFIG, check_serve_config, load, our_app, settings_of

# what the GPU variant may change per deployment (placement and sizes); everything else must match
GPU_MAY_CHANGE = {"num_cpus", "num_gpus", "device", "dtype", "batching", "engine", "translation", "autoscaling_config",
                  "max_ongoing_requests", "max_queued_requests"}


@pytest.mark.parametrize("path", [CPU_CONFIG, GPU_CONFIG], ids=["cpu", "gpu"])
def test_config_is_valid_for_ray_and_our_settings(path: Any) -> None:
    config = load(path)
    assert check_serve_config(config) == []
    s = settings_of(config)
    assert set(s.deployments) == {"encoder", "translator", "generator"}
    for name, dep in s.deployments.items():
        auto = dep.autoscaling_config
        assert auto is not None, f"{path.name}: {name} has no autoscaling_config"
        assert 1 <= auto["min_replicas"] <= auto["max_replicas"]
        assert auto["upscale_delay_s"] < auto["downscale_delay_s"]  # quick to add, slow to remove
        # replicas from what the replicas report (service/fleet/), not from ongoing requests
        policy = AutoscalingConfig(**auto).policy
        assert policy.policy_function == "service.fleet.autoscaling:LoadPolicy", name
        targets = policy.policy_kwargs["targets"]
        assert set(targets) == ({"queued", "kv_usage", "ttft_s", "itl_s"} if name == "generator" else {"queued"}), name
        assert LoadPolicy(targets).targets == targets
        queue = dep.engine.max_queued if name == "generator" else dep.batching.max_queued
        assert 0 < targets["queued"] < queue, name  # a replica starts well before the queue refuses requests
        opts = deployment_options(name, dep, s, cluster_gpus=0)
        assert opts["autoscaling_config"] == auto and "num_replicas" not in opts
        assert opts["graceful_shutdown_timeout_s"] == dep.drain_grace_s
        assert ("request_router_config" in opts) == (name == "generator")  # prefix-aware; the others power of two


def test_cpu_config_runs_on_cpu_threads() -> None:
    s = settings_of(load(CPU_CONFIG))
    assert (s.device, s.dtype) == ("auto", "auto")
    for dep in s.deployments.values():
        assert dep.num_gpus is None and dep.num_cpus >= 1 and dep.threads() == int(dep.num_cpus)


def test_gpu_config_puts_every_model_on_a_shared_gpu_in_bfloat16() -> None:
    s = settings_of(load(GPU_CONFIG))
    gpus_at_min = 0.0
    for name, dep in s.deployments.items():
        assert s.device_for(dep) == ("cuda", "bfloat16"), name
        assert dep.num_gpus is not None and 0 < dep.num_gpus < 1, name
        opts = deployment_options(name, dep, s, cluster_gpus=0)  # explicit fractions, whatever the cluster has
        assert opts["ray_actor_options"]["num_gpus"] == dep.num_gpus
        gpus_at_min += dep.num_gpus * dep.autoscaling_config["min_replicas"]  # type: ignore[index]
    assert gpus_at_min <= 1.0  # the whole service starts on one GPU
    assert s.ingress.num_cpus == 0


def test_gpu_config_is_the_cpu_config_with_other_placement() -> None:
    cpu, gpu = load(CPU_CONFIG), load(GPU_CONFIG)
    assert {k: v for k, v in cpu.items() if k != "applications"} == \
           {k: v for k, v in gpu.items() if k != "applications"}
    cpu_app, gpu_app = our_app(cpu), our_app(gpu)
    assert {k: v for k, v in cpu_app.items() if k != "args"} == \
           {k: v for k, v in gpu_app.items() if k != "args"}
    cpu_args, gpu_args = cpu_app["args"], gpu_app["args"]
    skip = {"device", "dtype", "deployments"}
    assert {k: v for k, v in cpu_args.items() if k not in skip} == \
           {k: v for k, v in gpu_args.items() if k not in skip}
    assert set(cpu_args["deployments"]) == set(gpu_args["deployments"])
    for name, dep in cpu_args["deployments"].items():
        other = gpu_args["deployments"][name]
        changed = {k for k in set(dep) | set(other) if dep.get(k) != other.get(k)}
        # the CPU generator runs its GGUF's 4-bit blocks on our CPU kernels, compiled, in float32
        may = GPU_MAY_CHANGE | ({"model", "dtype"} if name == "generator" else set())
        assert changed <= may, f"{name}: {sorted(changed - may)} differ"
    cpu_s, gpu_s = settings_of(cpu), settings_of(gpu)
    cpu_models = {n: d.model for n, d in cpu_s.deployments.items()}
    cpu_models["generator"] = dataclasses.replace(cpu_models["generator"], quantize=None, compile=False,
                                                  prompt_weights="same")
    assert cpu_models == {n: d.model for n, d in gpu_s.deployments.items()}


def test_a_misspelt_key_is_named() -> None:
    config = load(CPU_CONFIG)
    our_app(config)["args"]["deployments"]["encoder"]["autoscaling_config"]["downscale_delay"] = 5
    config["http_option"] = {}
    problems = check_serve_config(config)
    assert problems[0] == "config.http_option"
    assert any("unknown keys ['downscale_delay']" in p for p in problems)
