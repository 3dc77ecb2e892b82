"""Our service for the benchmark: the shipped Serve config (deploy/serve_config.yaml), narrowed to the
deployments the benchmark's tasks need, written to a file that `python -m service --config` reads.

Each deployment keeps its settings from the shipped config (batching knobs, CPUs, queues); the
benchmark sets only the model (for a non-default model set), torch threads, one replica per model
(no autoscaling, so every system computes on the same threads), device, the request deadline, and
HTTP on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .modelsets import DEPLOYMENT_FOR_TASK, model_set, spec_dict

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = ROOT / "deploy" / "serve_config.yaml"


def unsupported(tasks: Sequence[str]) -> dict[str, str]:
    """task -> why this checkout of the service cannot serve it (a deployment kind it lacks)."""
    from models.spec import TASK_KIND
    from service.deployments import DEPLOYMENTS

    return {
        t: f"service/deployments.py has no {TASK_KIND[t]!r} deployment kind yet"
        for t in tasks
        if TASK_KIND[t] not in DEPLOYMENTS
    }


def serve_config(
    tasks: Sequence[str],
    models: str,
    port: int,
    threads: int,
    device: str,
    request_timeout_s: float,
    shipped: dict[str, Any],
    gpus: int = 0,
    dtype: str = "auto",
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The shipped config with only the deployments for `tasks` (see the module docstring). With
    `gpus` visible and a device that may be CUDA, the deployments share them (Serve would otherwise
    give each replica a whole GPU, and on one GPU only the first would start). `overrides`: deployment
    name -> settings merged into it (a mapping into the shipped mapping), for a variant of ours."""
    config = dict(shipped)
    app = dict(config["applications"][0])
    args = dict(app.get("args") or {})
    configured = args.get("deployments") or {}
    specs = model_set(models) if models != "default" else {}
    deployments: dict[str, Any] = {}
    for task in tasks:
        name = DEPLOYMENT_FOR_TASK[task]
        dep = dict(configured.get(name) or {})
        if task in specs:
            dep["model"] = spec_dict(specs[task])
        dep["torch_threads"] = threads
        dep.pop("autoscaling_config", None)  # one replica per model, like the alternatives' one process
        dep["num_replicas"] = 1
        if dtype != "auto":  # every model in this dtype, whatever the shipped config says
            dep.pop("dtype", None)
        for key, value in ((overrides or {}).get(name) or {}).items():
            dep[key] = {**(dep.get(key) or {}), **value} if isinstance(value, Mapping) else value
        if gpus and device != "cpu" and dep.get("num_gpus") is None:
            dep["num_gpus"] = round(gpus / len(tasks), 3)
        deployments[name] = dep
    args["deployments"] = deployments
    args["request_timeout_s"] = max(float(args.get("request_timeout_s", 0)), request_timeout_s)
    if device != "auto":
        args["device"] = device
    if dtype != "auto":
        args["dtype"] = dtype
    app["args"] = args
    config["applications"] = [app]
    config["http_options"] = {**(config.get("http_options") or {}), "host": "127.0.0.1", "port": port}
    return config


def write_config(
    tasks: Sequence[str],
    models: str,
    port: int,
    threads: int,
    device: str,
    request_timeout_s: float,
    path: Path,
    dtype: str = "auto",
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    import torch

    shipped = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config = serve_config(
        tasks, models, port, threads, device, request_timeout_s, shipped, torch.cuda.device_count(), dtype,
        overrides,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
