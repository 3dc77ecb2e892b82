"""The Ray Serve application: a FastAPI ingress in front of one deployment per model.

    serve run deploy/serve_config.yaml          # the config's `args` become the settings
    serve run service.app:build_app device=cpu  # or args on the command line
    python -m service                           # = make serve: local Ray + the config above

Hops per request: ingress replica (validate, route) -> model replica (batch, run). `python -m
service` turns on Ray Serve's throughput mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1): the ingress replica
serves HTTP itself and replicas talk gRPC; without it, Serve's HTTP proxy adds a hop in front.
The ingress builds its FastAPI app in the replica (`__serve_build_asgi_app__`), from the settings
it was bound with; nothing is built at import time.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.deployment import Application
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from .api import create_api
from .errors import InternalError, NotReady, Overloaded, ServiceError
from .logs import configure_logging, serve_logging_config
from .messages import ModelInfo
from .metrics import default_metrics_dir, replica_actor_options
from .settings import Settings

log = logging.getLogger("ray.serve")


def _as_service_error(deployment: str, exc: BaseException) -> ServiceError:
    """Ray's exceptions from a model call -> the API's errors (a replica's ServiceError passes through)."""
    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    if isinstance(cause, ServiceError):
        return cause
    if isinstance(cause, BackPressureError):
        return Overloaded(f"{deployment}: too many queued requests; retry later")
    if isinstance(cause, DeploymentUnavailableError):
        return NotReady(f"{deployment}: the deployment failed to start; see the server log")
    if isinstance(cause, RayActorError):
        return NotReady(f"{deployment}: the model replica died; retry later")
    log.error("%s: unexpected error from the model replica: %r", deployment, cause)
    return InternalError(f"{deployment}: internal error; see the server log")


class ServeBackend:
    """Model calls through Serve handles (see routing.Backend). The first call to a deployment checks
    that it has a loaded replica (503 model_not_ready otherwise) instead of queueing behind a load;
    so does the first call after one found no replica (it died): while a new one loads, requests get
    a 503 within readiness_timeout_s rather than wait in Serve's queue until their deadline."""

    def __init__(self, handles: dict[str, DeploymentHandle], readiness_timeout_s: float) -> None:
        self.handles = handles
        self.streaming = {name: handle.options(stream=True) for name, handle in handles.items()}
        self.readiness_timeout_s = readiness_timeout_s
        self._seen_ready: set[str] = set()

    async def call(self, deployment: str, method: str, *args: Any) -> Any:
        if deployment not in self._seen_ready:
            await self.info(deployment, self.readiness_timeout_s)
        response = getattr(self.handles[deployment], method).remote(*args)
        try:
            return await response
        except asyncio.CancelledError:  # deadline or client gone: cancel the model call too
            response.cancel()
            raise
        except RequestCancelledError:
            raise asyncio.CancelledError() from None
        except Exception as e:
            raise self._failed(deployment, e) from None

    async def stream(self, deployment: str, method: str, *args: Any) -> AsyncIterator[Any]:
        """Items of a generator method, through Serve's streaming responses."""
        if deployment not in self._seen_ready:
            await self.info(deployment, self.readiness_timeout_s)
        response = getattr(self.streaming[deployment], method).remote(*args)
        ended = False
        try:
            async for item in response:
                yield item
            ended = True
        except RequestCancelledError:
            raise asyncio.CancelledError() from None
        except Exception as e:
            ended = True
            raise self._failed(deployment, e) from None
        finally:
            if not ended:  # closed early, or the reading task was cancelled: cancel the model call too
                response.cancel()

    async def info(self, deployment: str, timeout_s: float) -> ModelInfo:
        response = self.handles[deployment].info.remote()
        try:
            info = await asyncio.wait_for(_wait(response), timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            self._seen_ready.discard(deployment)
            raise NotReady(f"{deployment}: no loaded replica answered within {timeout_s:g} s") from None
        except Exception as e:
            raise self._failed(deployment, e) from None
        self._seen_ready.add(deployment)
        return info

    def _failed(self, deployment: str, exc: BaseException) -> ServiceError:
        err = _as_service_error(deployment, exc)
        if isinstance(err, NotReady):  # no replica: probe before the next call
            self._seen_ready.discard(deployment)
        return err


async def _wait(response: Any) -> Any:
    return await response


@serve.deployment
@serve.ingress()
class Ingress:
    """Validates, routes and converts; the model deployments batch and compute."""

    def __init__(self, settings: Settings, handles: dict[str, DeploymentHandle]) -> None:
        configure_logging(settings.log_json)
        self.settings = settings
        self.backend = ServeBackend(handles, settings.readiness_timeout_s)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_api(self.settings, self.backend, proxy_echoes_id=True)


def build_app_from_settings(settings: Settings) -> Application:
    from .deployments import bind_model  # torch and the models: not needed in the ingress replica

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
    ).bind(settings, models)


def build_app(args: dict[str, Any]) -> Application:
    """Application builder for `serve run`: settings from `args` and TS_* environment variables."""
    return build_app_from_settings(Settings.build(args, os.environ))
