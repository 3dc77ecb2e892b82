"""The processes of a local Ray Serve, found among one process's descendants (so another person's
Ray on the same machine is never matched): their pids, resident memory, and SIGKILL for fault tests.

Ray titles an actor's worker process `ray::<ActorClass>...`; a Serve replica's class is
`ServeReplica:<app>:<deployment>`, the proxy's `ProxyActor`, the controller's `ServeController`.
"""

from __future__ import annotations

import contextlib
import os
import re

import psutil

_REPLICA = re.compile(r"ray::ServeReplica:([^:\s]+):([^\s.]+)")


def serve_replicas(root_pid: int | None = None) -> dict[tuple[str, str], list[psutil.Process]]:
    """(app, deployment) -> its live replica processes, among the descendants of `root_pid` (default:
    this process, which started Ray with ray.init(address="local"))."""
    root = psutil.Process(root_pid or os.getpid())
    found: dict[tuple[str, str], list[psutil.Process]] = {}
    for proc in root.children(recursive=True):
        try:
            match = _REPLICA.search(" ".join(proc.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if match:
            found.setdefault((match.group(1), match.group(2)), []).append(proc)
    return found


def replica_pids(app: str, deployment: str, root_pid: int | None = None) -> list[int]:
    return [p.pid for p in serve_replicas(root_pid).get((app, deployment), [])]


def rss_mib(procs: list[psutil.Process]) -> float:
    """Resident memory of the processes together, MiB (those gone meanwhile count 0)."""
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            total += proc.memory_info().rss
    return total / 2**20


def replica_rss_mib(root_pid: int | None = None) -> dict[str, float]:
    """'<app>/<deployment>' -> resident MiB of its replica processes."""
    return {f"{app}/{dep}": rss_mib(procs) for (app, dep), procs in sorted(serve_replicas(root_pid).items())}
