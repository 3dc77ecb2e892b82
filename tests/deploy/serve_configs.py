"""Loading a Serve config (the file `serve run` / `serve deploy` take, or a RayService's serveConfigV2)
the way Ray and our service read it, strictly: Ray's schema accepts unknown keys silently, so they are
named here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CPU_CONFIG = ROOT / "deploy" / "serve_config.yaml"
GPU_CONFIG = ROOT / "deploy" / "serve_config.gpu.yaml"
OUR_APP = "service.app:build_app"


def _unknown(data: dict[str, Any], schema: Any, where: str) -> list[str]:
    return [f"{where}.{key}" for key in sorted(set(data) - set(schema.model_fields))]


def check_serve_config(config: dict[str, Any]) -> list[str]:
    """Problems of a Serve config: Ray's ServeDeploySchema errors, keys Ray does not know, and the
    application `args` that our Settings reject (validation errors as text). Empty when valid."""
    from pydantic import ValidationError
    from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as e:
        return [f"Ray's ServeDeploySchema: {e}"]
    problems = _unknown(config, ServeDeploySchema, "config")
    problems += _unknown(config.get("http_options") or {}, HTTPOptionsSchema, "http_options")
    for i, app in enumerate(config["applications"]):
        problems += _unknown(app, ServeApplicationSchema, f"applications[{i}]")
        if app.get("import_path") != OUR_APP:
            problems.append(f"applications[{i}].import_path is {app.get('import_path')!r}, not {OUR_APP}")
            continue
        try:
            Settings.build(app.get("args"), env={})
        except ValidationError as e:
            problems.append(f"applications[{i}].args: {e}")
    return problems


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def our_app(config: dict[str, Any]) -> dict[str, Any]:
    """The one application of ours in a config (AssertionError otherwise)."""
    (app,) = [a for a in config["applications"] if a.get("import_path") == OUR_APP]
    return app


def settings_of(config: dict[str, Any]) -> Settings:
    return Settings.build(our_app(config)["args"], env={})
