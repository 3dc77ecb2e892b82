"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's names and bodies), when the service
allows adapters named at run time (`runtime_adapters`; behind the API keys like every route).

A load is checked on a replica of the base model (its files, its type, its shapes against the model:
a 400 naming what is wrong, and the replica serves on) before the name routes there; other replicas
load it from its directory on their first request for it. Unloading forgets the name here and frees
the slot of the replica the call reaches (the others free theirs as least recently used).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from ..errors import InvalidAdapter, InvalidRequest, ModelNotFound, NotFound
from ..messages import AdapterRef
from ..settings import Settings
from .adapters import NAME, AdapterEntry
from .routing import Backend, ModelRoutes
from .schemas import LoadAdapterRequest, UnloadAdapterRequest

# vLLM's answers are plain text; every error is our JSON (ErrorResponse)
DONE: dict[int | str, dict[str, Any]] = {200: {"description": "Done (vLLM's text)",
                                              "content": {"text/plain": {"schema": {"type": "string"}}}}}


def adapter_router(settings: Settings, routes: ModelRoutes, backend: Backend, errors: dict[int | str, Any]
                   ) -> APIRouter:
    router = APIRouter(tags=["adapters"])
    registry = routes.adapters

    def allowed() -> None:
        if not settings.runtime_adapters:
            raise NotFound("loading adapters at run time is off on this server (runtime_adapters: false); "
                           "list them in the config (adapters, adapter_dir)")

    def base_deployment(base: str | None) -> tuple[str, str]:
        """(deployment, model name) of the model an adapter is loaded onto."""
        for name, dep in settings.deployments.items():
            assert dep.model is not None
            if registry.slots.get(name) and (base is None and dep.model.kind == "generator" or base == dep.model.name):
                return name, dep.model.name
        if base is None:
            raise InvalidRequest("no generator on this server serves adapters (max_adapters)", "base_model")
        raise ModelNotFound(f"no model {base!r} serving adapters on this server", "base_model")

    @router.post("/v1/load_lora_adapter", responses={**errors, **DONE})
    async def load_lora_adapter(body: LoadAdapterRequest) -> PlainTextResponse:
        """Serve a LoRA adapter from a directory under a new name."""
        allowed()
        name = body.lora_name
        if not NAME.fullmatch(name):
            raise InvalidRequest(f"lora_name {name!r}: letters, digits and . _ : - only, at most 128", "lora_name")
        taken = {r.model for rs in routes.by_task.values() for r in rs}
        if name in taken or registry.find(name) is not None:
            raise InvalidAdapter(f"the name {name!r} is taken by a model or an adapter", "lora_name")
        if not Path(body.lora_path).is_dir():
            raise InvalidAdapter(f"lora_path {body.lora_path!r} is not a directory on the server", "lora_path")
        deployment, base = base_deployment(body.base_model)
        await backend.call(deployment, "load_adapter", AdapterRef(name, body.lora_path))
        registry.add(AdapterEntry(name, deployment, base, body.lora_path, "runtime"))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", responses={**errors, **DONE})
    async def unload_lora_adapter(body: UnloadAdapterRequest) -> PlainTextResponse:
        """Stop serving an adapter loaded at run time."""
        allowed()
        entry = registry.find(body.lora_name)
        if entry is None:
            raise ModelNotFound(f"no adapter {body.lora_name!r}", "lora_name")
        if entry.source != "runtime":
            raise InvalidAdapter(f"adapter {body.lora_name!r} comes from the config ({entry.source}); remove it "
                                 "there", "lora_name")
        registry.remove(entry.name)
        await backend.call(entry.deployment, "unload_adapter", entry.name)
        return PlainTextResponse(f"Success: LoRA adapter '{entry.name}' removed successfully.")

    return router
