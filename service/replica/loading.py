"""A replica's model, loaded once in the replica's constructor: its threads set, the startup gate
passed (tests only), onto its device in its dtype."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from models.catalog import LoadedModel, load_model
from models.execution.planner import Runtime
from models.spec import ModelSpec

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
    loaded = load_model(dep.model, settings.cache_path(), device=device, dtype=dtype, runtime=runtime)
    spec = dep.engine.speculative if dep.model.kind == "generator" else None
    if spec is not None and spec.method == "draft":
        loaded = dataclasses.replace(loaded, draft=load_model(draft_spec(dep.model, spec.draft), settings.cache_path(),
                                                              device=device, dtype=dtype, runtime=runtime))
    return dep, loaded


def draft_spec(model: ModelSpec, changes: Mapping[str, Any]) -> ModelSpec:
    """The draft model's spec: the deployment's model with `changes` (SpeculativeConfig.draft), named
    after it; ValueError for a field a ModelSpec does not have."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(ModelSpec)}
    if unknown:
        raise ValueError(f"speculative.draft: {sorted(unknown)} are not model spec fields")
    fields = {"name": f"{model.name}-draft", **changes}
    if "quantize" in changes and "prompt_weights" not in changes:
        fields["prompt_weights"] = "same"  # a draft's prompts are its catch-up: its own weights
    return dataclasses.replace(model, **fields)


def wait_for_gate(path: str | None) -> None:
    """Block until the file `path` exists (at most GATE_TIMEOUT_S); tests hold a replica's load this way."""
    if path is None:
        return
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
