"""Where Serve's ingress replicas listen: the HTTP target group of our application, as Serve's
controller reports it (`get_target_groups`, the call Ray's own HAProxy manager follows; its types,
`ray.serve.schema.TargetGroup` / `Target`, are a public alpha API). With throughput mode's direct
ingress each running ingress replica is one target (its node's IP, its own port); with no running
replica, or without direct ingress, the target is Serve's proxy.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .config import Address


class _Target(Protocol):
    ip: str
    port: int


class _Group(Protocol):
    targets: list[_Target]
    route_prefix: str
    protocol: Any


def http_targets(groups: Iterable[_Group], route_prefix: str = "/", host: str | None = None) -> tuple[Address, ...]:
    """The HTTP targets serving `route_prefix`, sorted, each once. `host`: connect to every target
    there instead of its node's IP (a single-node service whose Serve servers bind a loopback address)."""
    found = {Address(host or t.ip, t.port) for g in groups
             if str(getattr(g.protocol, "value", g.protocol)).upper() == "HTTP" and g.route_prefix == route_prefix
             for t in g.targets}
    return tuple(sorted(found, key=lambda a: (a.host, a.port)))


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve_targets(controller: Any, route_prefix: str = "/", host: str | None = None,
                  timeout_s: float = 5.0) -> Callable[[], tuple[Address, ...]]:
    """A function asking Serve's controller (an actor handle) for the targets, as `http_targets`."""
    import ray  # only here: the front's other modules run without Ray

    def ask() -> tuple[Address, ...]:
        return http_targets(ray.get(controller.get_target_groups.remote(), timeout=timeout_s), route_prefix, host)

    return ask


def serve_controller() -> Any:
    """The handle of the running Serve's controller (this process is connected to its Ray)."""
    from ray.serve.context import _get_global_client  # Serve's own accessor; one place to follow Ray

    return _get_global_client()._controller
