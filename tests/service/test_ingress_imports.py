"""The ingress replica never imports torch: whatever crosses from a model replica to it (results,
and the errors inside Ray's RayTaskError) unpickles there, which imports the defining module. A
module that imports torch made the first burst of 503s stall the ingress for ~1.5 s."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import service
from service.errors import ServiceError


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


def test_errors_and_messages_import_without_torch() -> None:
    for info in pkgutil.iter_modules(service.__path__):
        if info.name != "__main__":
            importlib.import_module(f"service.{info.name}")  # so every ServiceError subclass is defined
    errors = {cls.__module__ for cls in _subclasses(ServiceError)}
    assert "service.engine_errors" in errors and len(errors) >= 2, errors
    modules = sorted(errors | {"service.app", "service.messages"})
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'models', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"the ingress side imports {out.stdout.strip()} via {modules}"
