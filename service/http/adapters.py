"""The LoRA adapters the ingress routes to (no torch: it reads only names and paths).

An adapter is a model of its own to clients: its name in a request's `model` selects the deployment
of its base model, and the request carries the adapter's directory, from which a replica that does
not hold it yet loads it (service/replica/generator.py, models/adapters/). Where adapters come from:
the config (a model's `adapters`), a model's `adapter_dir` (any subdirectory with an
adapter_config.json, found by name, so every ingress replica finds the same ones), and, when the
service allows it (`runtime_adapters`), POST /v1/load_lora_adapter on this ingress replica.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..settings import Settings

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # what an adapter may be called (no path parts)


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    deployment: str
    base: str  # its base model's name (`parent` in /v1/models)
    path: str
    source: str  # "config", "adapter_dir" or "runtime"


class AdapterRegistry:
    """name -> AdapterEntry over the configured deployments; one per ingress replica (its event loop)."""

    def __init__(self, settings: Settings) -> None:
        self._config: dict[str, AdapterEntry] = {}
        self._dirs: list[tuple[str, str, Path]] = []  # (deployment, base model, directory)
        self._runtime: dict[str, AdapterEntry] = {}
        self.slots: dict[str, int] = {}  # deployment -> adapters a replica holds (0: none)
        for dep_name, dep in settings.deployments.items():
            spec = dep.model
            assert spec is not None
            self.slots[dep_name] = spec.adapter_slots()
            for name, path in spec.adapters.items():
                self._config[name] = AdapterEntry(name, dep_name, spec.name, str(path), "config")
            if spec.adapter_dir:
                self._dirs.append((dep_name, spec.name, Path(spec.adapter_dir)))

    def find(self, name: str) -> AdapterEntry | None:
        """The adapter called `name`: loaded at run time, configured, or a subdirectory of an adapter_dir."""
        entry = self._runtime.get(name) or self._config.get(name)
        if entry is not None or not NAME.fullmatch(name):
            return entry
        for dep_name, base, root in self._dirs:
            path = root / name
            if (path / "adapter_config.json").is_file():
                return AdapterEntry(name, dep_name, base, str(path), "adapter_dir")
        return None

    def listed(self) -> list[AdapterEntry]:
        """Every adapter a request may name now (an adapter_dir's as its subdirectories are now)."""
        found = {**self._config, **self._runtime}
        for dep_name, base, root in self._dirs:
            if root.is_dir():
                for sub in sorted(root.iterdir()):
                    if sub.name not in found and NAME.fullmatch(sub.name) and (sub / "adapter_config.json").is_file():
                        found[sub.name] = AdapterEntry(sub.name, dep_name, base, str(sub), "adapter_dir")
        return list(found.values())

    def add(self, entry: AdapterEntry) -> None:
        self._runtime[entry.name] = entry

    def remove(self, name: str) -> AdapterEntry | None:
        """Forget a runtime adapter; None when `name` is not one."""
        return self._runtime.pop(name, None)
