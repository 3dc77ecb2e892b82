"""A free local port for a server this process starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray Serve's default port ranges for the ingress replicas' own HTTP and gRPC servers
# (RAY_SERVE_DIRECT_INGRESS_{MIN,MAX}_{HTTP,GRPC}_PORT)
DIRECT_INGRESS = ((30000, 31000), (40000, 41000))

def free_port() -> int:
    """A free 127.0.0.1 port below the kernel's ephemeral range: Ray's own connections take their
    ports from that range, so a port picked there (bind to 0) can be taken again before Serve binds it
    (seen as "Failed to bind to address" in one full test run in four). Nor one in the ranges Serve
    hands its ingress replicas in throughput mode (DIRECT_INGRESS)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if any(first <= port <= last for first, last in DIRECT_INGRESS):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below the range taken: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
