"""The ingress deployment: the FastAPI app (service/http/) in a Ray Serve replica, calling the model
deployments through Serve handles. No torch here: this module is all the ingress replica imports.

The ingress builds its FastAPI app in the replica (`__serve_build_asgi_app__`), from the settings
it was bound with; nothing is built at import time. Ray's exceptions from a model call become the
API's errors (service/errors.py) here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from .errors import InternalError, NotReady, Overloaded, ServiceError
from .fleet.router import decision_counters, routed_request
from .http.api import create_api
from .http.routing import probed_readiness
from .messages import AdapterRef, ModelInfo
from .settings import Settings
from .telemetry.logs import configure_logging
from .telemetry.metrics import bind_to_node

log = logging.getLogger(__name__)
READINESS_CACHE_S = 1.0  # /readyz answers from a look-up at most this old


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


def adapter_of(args: Sequence[Any]) -> str | None:
    """The LoRA adapter a model call is for: an AdapterRef among its arguments, or its generation's."""
    for arg in args:
        if isinstance(arg, AdapterRef):
            return arg.name
    request = routed_request(args)
    return request.adapter.name if request is not None and request.adapter is not None else None


class ServeBackend:
    """Model calls through Serve handles (see service/http/routing.py Backend). The first call to a deployment checks
    that it has a loaded replica (503 model_not_ready otherwise) instead of queueing behind a load;
    so does the first call after one found no replica (it died): while a new one loads, requests get
    a 503 within readiness_timeout_s rather than wait in Serve's queue until their deadline."""

    def __init__(self, handles: dict[str, DeploymentHandle], readiness_timeout_s: float) -> None:
        self.handles = handles
        self.streaming = {name: handle.options(stream=True) for name, handle in handles.items()}
        self.readiness_timeout_s = readiness_timeout_s
        self._seen_ready: set[str] = set()
        self._probes: dict[str, asyncio.Future[ModelInfo]] = {}  # in flight, by deployment (_ready)
        self._readiness: tuple[float, dict[str, str]] | None = None  # (when, states)
        self._readiness_lock = asyncio.Lock()
        self._states_cache: tuple[float, dict[str, dict[str, int]]] | None = None  # (when, _replica_states())

    def _handle(self, deployment: str, args: Sequence[Any], stream: bool = False) -> DeploymentHandle:
        """The deployment's handle for a call with `args`: one for a LoRA adapter carries it as Serve's
        multiplexed model id, so that Serve's routers prefer the replicas that hold it."""
        handle = (self.streaming if stream else self.handles)[deployment]
        adapter = adapter_of(args)
        return handle if adapter is None else handle.options(multiplexed_model_id=adapter)

    async def call(self, deployment: str, method: str, *args: Any) -> Any:
        await self._ready(deployment)
        response = getattr(self._handle(deployment, args), method).remote(*args)
        try:
            result = await response
        except asyncio.CancelledError:  # deadline or client gone: cancel the model call too
            response.cancel()
            raise
        except RequestCancelledError:
            raise asyncio.CancelledError() from None
        except Exception as e:
            raise self._failed(deployment, e) from None
        if isinstance(result, ServiceError):  # a refusal, returned as a value (service/deployments.py)
            raise self._failed(deployment, result)
        return result

    async def stream(self, deployment: str, method: str, *args: Any) -> AsyncIterator[Any]:
        """Items of a generator method, through Serve's streaming responses."""
        await self._ready(deployment)
        response = getattr(self._handle(deployment, args, stream=True), method).remote(*args)
        ended = False
        try:
            async for item in response:
                if isinstance(item, ServiceError):  # a refusal, the stream's last item
                    ended = True
                    raise item
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

    async def _ready(self, deployment: str) -> None:
        """Before a call to a deployment not seen answering (start-up, after an outage): one info()
        probe, shared by every call that arrives meanwhile (a burst during an outage made one probe a
        request, each waiting in Serve's router for a replica). NotReady when it does not answer."""
        if deployment in self._seen_ready:
            return
        probe = self._probes.get(deployment)
        if probe is None or probe.done():
            probe = asyncio.ensure_future(self.info(deployment, self.readiness_timeout_s))
            self._probes[deployment] = probe

            def forget(done: asyncio.Future[ModelInfo]) -> None:
                if self._probes.get(deployment) is done:
                    del self._probes[deployment]
                if not done.cancelled():
                    done.exception()  # retrieved: every caller may have gone away before it ended

            probe.add_done_callback(forget)
        await asyncio.shield(probe)  # a caller that goes away leaves the probe to the others

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

    async def readiness(self, deployments: list[str], timeout_s: float) -> dict[str, str]:
        """Readiness for /readyz, cached for READINESS_CACHE_S. A deployment is ready when Serve's
        controller counts a RUNNING replica of it (its constructor loaded and warmed the model) and
        this ingress has seen one answer since it last saw one fail; only a deployment not yet seen
        (start-up, an outage) is probed with an info() call, so a probe never queues behind model
        requests nor takes their replicas' slots while they serve."""
        cached = self._readiness
        if cached is not None and time.monotonic() - cached[0] < READINESS_CACHE_S:
            return cached[1]
        async with self._readiness_lock:  # concurrent probes share one look-up
            cached = self._readiness
            if cached is not None and time.monotonic() - cached[0] < READINESS_CACHE_S:
                return cached[1]
            try:
                running = {d: states.get("RUNNING", 0) for d, states in (await self._states()).items()}
            except Exception as e:  # the controller did not answer: the replicas themselves decide
                log.warning("readiness: Serve's status is unavailable (%r); probing the replicas", e)
                running = dict.fromkeys(deployments, 1)
            states = {d: f"{d}: no running replica" for d in deployments if not running.get(d)}
            states |= {d: "ready" for d in deployments if d not in states and d in self._seen_ready}
            unseen = [d for d in deployments if d not in states]
            states |= await probed_readiness(self, unseen, timeout_s)
            states = {d: states[d] for d in deployments}
            self._readiness = (time.monotonic(), states)
            return states

    async def replica_states(self) -> dict[str, dict[str, int]]:
        try:
            return await self._states()
        except Exception:  # noqa: BLE001 - the controller did not answer: nothing to say
            return {}

    async def _states(self) -> dict[str, dict[str, int]]:
        """Serve's replica states of this application, at most READINESS_CACHE_S old."""
        cached = self._states_cache
        if cached is None or time.monotonic() - cached[0] >= READINESS_CACHE_S:
            cached = self._states_cache = (time.monotonic(), await asyncio.to_thread(_replica_states))
        return cached[1]

    def _failed(self, deployment: str, exc: BaseException) -> ServiceError:
        err = _as_service_error(deployment, exc)
        if isinstance(err, NotReady):  # no replica: probe before the next call
            self._seen_ready.discard(deployment)
        return err


async def _wait(response: Any) -> Any:
    return await response


def _replica_states() -> dict[str, dict[str, int]]:
    """deployment -> {state: replicas}, in this ingress's application (Serve's controller)."""
    app = serve.get_replica_context().app_name
    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {name: {str(getattr(state, "value", state)): n for state, n in d.replica_states.items()}
            for name, d in status.deployments.items()}


@serve.deployment
@serve.ingress()
class Ingress:
    """Validates, routes and converts; the model deployments batch and compute."""

    def __init__(self, settings: Settings, handles: dict[str, DeploymentHandle]) -> None:
        configure_logging(settings.log_json)
        bind_to_node(ray.get_runtime_context().get_node_id())  # /metrics: this node's replicas
        for name, dep in settings.deployments.items():  # their routers' decisions, exported at 0
            if dep.routing_policy().policy == "prefix":
                decision_counters(name)
        self.settings = settings
        self.backend = ServeBackend(handles, settings.readiness_timeout_s)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_api(self.settings, self.backend, proxy_echoes_id=True)
