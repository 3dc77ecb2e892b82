"""The local Ray Serve of the end-to-end tests: loadtests/cluster.py, shared with the commands.

Each e2e module starts its own cluster (module-scoped fixtures) and shuts it down.
"""

from loadtests.cluster import deploy, free_port, local_cluster, wait_for

__all__ = ["deploy", "free_port", "local_cluster", "wait_for"]
