"""The import rules of the service's layout, each folder walked module by module in a fresh
interpreter, so a rule cannot erode unseen:

- the ingress side (service/http/, service/telemetry/, errors.py, messages.py, settings.py,
  ingress.py, service/fleet/: the router runs in the ingress, the autoscaling policy in Serve's
  controller) and the nginx front (service/front/) never import torch, transformers or a models/ module that pulls torch: whatever
  crosses from a model replica to the ingress unpickles there (a module that imported torch made
  the first burst of 503s stall the ingress for ~1.5 s);
- service/engine/ imports neither Ray nor FastAPI, nor the replica or HTTP code around it;
- service/replica/ imports neither Ray nor FastAPI (the Ray wrappers are service/deployments.py);
- service/common/, the helpers both sides use, imports what both sides may: neither torch nor FastAPI
  nor Ray;
- models/ imports nothing from service/; nothing but tests and load tests imports service/testing/;
- every error a replica can raise is defined on the torch-free side.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys

import pytest

from service.errors import ServiceError

INGRESS_SIDE = ["service.http", "service.telemetry", "service.errors", "service.messages", "service.common", "service.settings",
                "service.ingress", "service.front", "service.fleet"]
TORCH_SIDE = ("torch", "transformers", "safetensors", "tokenizers")
WEB_AND_RAY = ("ray", "fastapi", "starlette", "uvicorn")


def modules_under(*names: str) -> list[str]:
    """Each name, and for a package every module inside it (not __main__)."""
    out = []
    for name in names:
        out.append(name)
        module = importlib.import_module(name)
        if hasattr(module, "__path__"):
            out += [m.name for m in pkgutil.walk_packages(module.__path__, f"{name}.")
                    if not m.name.endswith("__main__")]
    return out


def imported_after(modules: list[str]) -> set[str]:
    """Every module in sys.modules after a fresh interpreter imports `modules`."""
    code = (f"import json, sys\nfor m in {modules!r}: __import__(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def under(loaded: set[str], packages: tuple[str, ...]) -> list[str]:
    """The modules of `loaded` that belong to one of the top-level `packages`."""
    return sorted(m for m in loaded if m.split(".")[0] in packages)


def test_the_ingress_side_never_imports_torch() -> None:
    modules = modules_under(*INGRESS_SIDE)
    assert "service.http.generation" in modules and "service.telemetry.observers" in modules  # the walk works
    loaded = imported_after(modules)
    assert not under(loaded, TORCH_SIDE), f"the ingress side imports {under(loaded, TORCH_SIDE)[:8]}"
    assert set(under(loaded, ("models",))) <= {"models", "models.spec"}  # the torch-free ModelSpec only


@pytest.mark.parametrize("package", ["service.engine", "service.replica"])
def test_the_engine_and_the_replicas_import_neither_ray_nor_fastapi(package: str) -> None:
    modules = modules_under(package)
    assert len(modules) >= 6
    loaded = imported_after(modules)
    bad = under(loaded, WEB_AND_RAY)
    assert not bad, f"{package} imports {bad[:8]}"
    assert "torch" in loaded  # they do run the model: the check above is not vacuous
    if package == "service.engine":
        around = [m for m in loaded if m.startswith(("service.replica", "service.http", "service.deployments"))]
        assert not around, f"the engine imports the code around it: {around}"


def test_the_common_helpers_import_neither_torch_nor_fastapi_nor_ray() -> None:
    modules = modules_under("service.common")
    assert {"service.common.documents", "service.common.tool_calls"} <= set(modules)  # the walk works
    loaded = imported_after(modules)
    bad = under(loaded, TORCH_SIDE + WEB_AND_RAY)
    assert not bad, f"service.common imports {bad[:8]}"
    assert set(under(loaded, ("models",))) <= {"models", "models.spec"}  # the torch-free ModelSpec only
    around = [m for m in loaded if m.startswith(("service.http", "service.replica", "service.engine", "service.deployments"))]
    assert not around, f"service.common imports one side's code: {around}"


def test_models_import_nothing_from_service_and_only_tests_import_service_testing() -> None:
    models = [m for m in modules_under("models") if not m.startswith("models.train.")]
    assert "models.inputs" in models and "models.catalog" in models
    assert not under(imported_after(models), ("service",))
    serving = [m for m in modules_under("service") if not m.startswith("service.testing")]
    assert "service.app" in serving and "service.deployments" in serving
    assert not [m for m in imported_after(serving) if m.startswith("service.testing")]


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


def test_every_service_error_is_defined_on_the_torch_free_side() -> None:
    for name in modules_under("service"):
        importlib.import_module(name)  # so every ServiceError subclass in the service is defined
    defined_in = {cls.__module__ for cls in _subclasses(ServiceError) if cls.__module__.startswith("service.")}
    assert "service.errors" in defined_in
    torch_free = set(modules_under(*INGRESS_SIDE))
    assert defined_in <= torch_free, f"errors defined outside the torch-free side: {defined_in - torch_free}"
