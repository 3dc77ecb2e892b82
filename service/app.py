"""The Ray Serve application: a FastAPI ingress (service/ingress.py) in front of one deployment per
model (service/deployments.py).

    serve run deploy/serve_config.yaml          # the config's `args` become the settings
    serve run service.app:build_app device=cpu  # or args on the command line
    python -m service                           # = make serve: local Ray + the config above

A request goes ingress replica (validate, route) -> model replica (batch, run); under throughput mode
(service/ray_env.py) the ingress serves HTTP itself, else Serve's proxy adds a hop. Each replica
imports only its own side: the ingress never torch, a model replica never FastAPI.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.serve.deployment import Application

from .deployments import bind_model
from .ingress import Ingress
from .settings import Settings
from .telemetry.logs import serve_logging_config
from .telemetry.metrics import default_metrics_dir, replica_actor_options


def build_app_from_settings(settings: Settings) -> Application:
    if settings.metrics_dir is None:  # one directory per deployed app, the same path on every node
        settings = settings.model_copy(update={"metrics_dir": default_metrics_dir()})
    cluster_gpus = float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0
    models = {name: bind_model(name, settings, cluster_gpus) for name in settings.deployments}
    ing = settings.ingress
    placement = {} if ing.max_replicas_per_node is None else {"max_replicas_per_node": ing.max_replicas_per_node}
    return Ingress.options(
        num_replicas=ing.num_replicas,
        ray_actor_options={"num_cpus": ing.num_cpus, **replica_actor_options(settings.metrics_dir)},
        logging_config=serve_logging_config(settings.log_json, settings.access_log),
        **placement,
        max_ongoing_requests=ing.max_ongoing_requests,
        max_queued_requests=ing.max_queued_requests,
        backpressure_config={"retry_after_s": settings.retry_after_s},
        # the ingress holds the HTTP side of every stream: it drains as long as the longest model grace
        graceful_shutdown_timeout_s=ingress_grace_s(settings),
    ).bind(settings, models)


def ingress_grace_s(settings: Settings) -> float:
    """How long a stopping ingress replica finishes its requests: the model deployments' longest drain
    plus a margin, so that a stream a model replica finishes also reaches its client."""
    return max(dep.drain_grace_s for dep in settings.deployments.values()) + INGRESS_MARGIN_S


INGRESS_MARGIN_S = 5.0


def build_app(args: dict[str, Any]) -> Application:
    """Application builder for `serve run`: settings from `args` and TS_* environment variables."""
    return build_app_from_settings(Settings.build(args, os.environ))
