"""Settings: defaults, Serve config args, TS_* overrides, validation, and the Serve options they give."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from models.catalog import DEFAULT_SPECS
from service.deployments import deployment_options
from service.settings import DeploymentSettings, Settings

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"
TINY = {"name": "tiny", "tasks": ["classify", "embed"], "source": "tiny:encoder"}


def test_defaults_serve_the_catalog_models() -> None:
    s = Settings.build(None, env={})
    assert set(s.deployments) == {"encoder", "translator", "generator"}
    assert s.deployments["encoder"].model == DEFAULT_SPECS["encoder"]
    assert s.deployments["translator"].model == DEFAULT_SPECS["translator"]
    assert s.deployments["generator"].model == DEFAULT_SPECS["generator"]


def test_the_shipped_serve_config_is_valid() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "service.app:build_app" and config["http_options"]["port"] == 8000
    s = Settings.build(app["args"], env={})
    assert s.deployments["encoder"].model.name == "minilm-sentiment"  # type: ignore[union-attr]
    assert s.deployments["translator"].batching.max_batch_size == 16
    assert s.deployments["generator"].model.kind == "generator"  # type: ignore[union-attr]
    engine = s.deployments["generator"].engine
    assert engine.max_running == 128 and engine.paged and s.deployments["generator"].num_cpus == 2
    # the default SmolLM2 from its GGUF's own 4-bit blocks, compiled, in float32 (docs/benchmarks.md)
    gen = s.deployments["generator"]
    assert gen.model == dataclasses.replace(DEFAULT_SPECS["generator"], quantize="q4_1", compile=True,
                                            prompt_weights="auto")
    assert gen.dtype == "float32"


def test_environment_overrides_nested_fields_with_json_values() -> None:
    env = {"TS_DEVICE": "cpu", "TS_REQUEST_TIMEOUT_S": "5", "TS_DEPLOYMENTS__ENCODER__NUM_REPLICAS": "2",
           "TS_DEPLOYMENTS__TRANSLATOR__BATCHING__MAX_WAIT_MS": "1.5", "OTHER": "ignored"}
    s = Settings.build({"max_inputs": 8}, env)
    assert s.device == "cpu" and s.request_timeout_s == 5.0 and s.max_inputs == 8
    assert s.deployments["encoder"].num_replicas == 2
    assert s.deployments["translator"].batching.max_wait_ms == 1.5
    assert s.deployments["translator"].model.name == "transformer-en-es"  # type: ignore[union-attr]


def test_args_deployments_are_the_whole_set() -> None:
    s = Settings.build({"deployments": {"enc": {"model": TINY}}}, env={})
    assert list(s.deployments) == ["enc"] and s.deployments["enc"].model.kind == "encoder"  # type: ignore[union-attr]


@pytest.mark.parametrize(("args", "env", "match"), [
    ({"devise": "cpu"}, {}, "devise"),
    ({}, {"TS_MAX_INPUTS": "many"}, "max_inputs"),
    ({"device": "gpu"}, {}, "device must be"),
    ({"dtype": "int8"}, {}, "dtype must be"),
    ({"deployments": {"mystery": {}}}, {}, "needs a model"),
    ({"deployments": {}}, {}, "no model deployments"),
    ({"deployments": {"a": {"model": TINY}, "b": {"model": TINY}}}, {}, "both serve model 'tiny'"),
    ({"deployments": {"t": {"model": {**TINY, "tasks": ["translate"]}}}}, {}, "names no languages"),
    ({"deployments": {"t": {"model": {**TINY, "tasks": ["classify", "translate"]}}}}, {}, "split them"),
    ({"max_inputs": 64, "deployments": {"a": {"model": TINY, "batching": {"max_queued": 8}}}}, {}, "max_queued"),
    ({"deployments": {"a b": {"model": TINY}}}, {}, "may use only"),
    ({"deployments": {"a": {"model": TINY, "autoscaling_config": {"max_replica": 2}}}}, {},
     r"unknown keys \['max_replica'\]"),
    ({"deployments": {"a": {"model": TINY, "autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}}}, {},
     "max_replicas .2. must be greater than or equal to min_replicas .3."),
    ({}, {"TS_DEPLOYMENTS__ENCODER__AUTOSCALING_CONFIG": '{"target_ongoing_requests": 0}'},
     "target_ongoing_requests: Input should be greater than 0"),
    ({"deployments": {"a": {"model": TINY, "heap_trim_interval_s": -1}}}, {}, "heap_trim_interval_s"),
])
def test_invalid_settings_name_the_problem(args: dict[str, Any], env: dict[str, str], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        Settings.build(args, env)


def test_a_model_is_quantized_from_its_settings() -> None:
    s = Settings.build({"deployments": {"enc": {"model": {**TINY, "quantize": "int8"}}}}, env={})
    assert s.deployments["enc"].model.quantize == "int8"  # type: ignore[union-attr]
    assert Settings.build({"deployments": {"enc": {"model": TINY}}}, env={}).deployments["enc"].model.quantize is None  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match=r"model.quantize\n  Input should be .int8."):
        Settings.build({"deployments": {"enc": {"model": {**TINY, "quantize": "int4"}}}}, env={})


def test_serving_options_of_a_default_model_are_set_alone() -> None:
    env = {"TS_DEPLOYMENTS__GENERATOR__MODEL__DENSE_KERNEL": "aten", "TS_DEPLOYMENTS__ENCODER__MODEL__QUANTIZE": "int8"}
    s = Settings.build(None, env=env)
    gen, enc = s.deployments["generator"].model, s.deployments["encoder"].model
    assert gen == dataclasses.replace(DEFAULT_SPECS["generator"], dense_kernel="aten")
    assert enc == dataclasses.replace(DEFAULT_SPECS["encoder"], quantize="int8")
    assert s.deployments["translator"].model == DEFAULT_SPECS["translator"]
    # a deployment with no default model of its name still needs a whole spec
    with pytest.raises(ValidationError, match="source"):
        Settings.build({"deployments": {"other": {"model": {"dense_kernel": "aten"}}}}, env={})


def test_deployment_options_follow_the_settings() -> None:
    s = Settings.build({"deployments": {"a": {"model": TINY, "num_replicas": 3, "num_cpus": 2}}}, env={})
    dep = s.deployments["a"]
    opts = deployment_options("a", dep, s, cluster_gpus=0)
    assert opts["num_replicas"] == 3 and opts["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert opts["max_ongoing_requests"] == 256 and opts["max_queued_requests"] == 1024
    assert deployment_options("a", dep, s, cluster_gpus=1)["ray_actor_options"]["num_gpus"] == 1.0
    cpu_only = dep.model_copy(update={"device": "cpu"})
    assert deployment_options("generator", cpu_only, s, cluster_gpus=1)["ray_actor_options"]["num_gpus"] == 0.0
    scaled = DeploymentSettings(model=dep.model, autoscaling_config={"min_replicas": 1, "max_replicas": 4})
    opts = deployment_options("encoder", scaled, s, cluster_gpus=0)
    assert "num_replicas" not in opts and opts["autoscaling_config"]["max_replicas"] == 4
    assert dep.threads() == 2 and DeploymentSettings(model=dep.model, num_cpus=0).threads() == 1


def test_engine_settings_of_a_generator() -> None:
    env = {"TS_DEPLOYMENTS__GENERATOR__ENGINE__MAX_RUNNING": "4", "TS_DEPLOYMENTS__GENERATOR__ENGINE__KV_CACHE_MIB": "64"}
    s = Settings.build(None, env)
    engine = s.deployments["generator"].engine
    assert engine.max_running == 4 and engine.kv_cache_mib == 64 and engine.max_total_tokens == 1024
    with pytest.raises(ValidationError, match="max_queued"):
        Settings.build({"deployments": {"generator": {"engine": {"max_queued": 0}}}}, env={})
