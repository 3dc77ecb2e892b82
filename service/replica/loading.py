"""A replica's model, loaded once in the replica's constructor: its threads set, the startup gate
passed (tests only), onto its device in its dtype."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from models.catalog import LoadedModel, load_model
from models.execution.planner import Runtime

from ..engine.core import engine_runtime
from ..settings import DeploymentSettings, Settings
from ..telemetry.logs import configure_logging
from .device import resolve_device

GATE_TIMEOUT_S = 600.0


def load_for_deployment(name: str, settings: Settings) -> tuple[DeploymentSettings, LoadedModel]:
    """The settings of deployment `name` and its model, loaded in this process."""
    dep = settings.deployments[name]
    assert dep.model is not None
    configure_logging(settings.log_json)  # this replica's own loggers; Serve's follow serve_logging_config
    torch.set_num_threads(dep.threads())
    wait_for_gate(dep.startup_gate)
    device, dtype = resolve_device(*settings.device_for(dep))
    # a generator's plan depends on its engine (a paged cache, graphs); the others' on nothing around them
    runtime = engine_runtime(dep.engine) if dep.model.kind == "generator" else Runtime()
    return dep, load_model(dep.model, settings.cache_path(), device=device, dtype=dtype, runtime=runtime)


def wait_for_gate(path: str | None) -> None:
    """Block until the file `path` exists (at most GATE_TIMEOUT_S); tests hold a replica's load this way."""
    if path is None:
        return
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
