"""Session-wide test settings."""

import os

# Ray Serve's throughput mode (the ingress serves HTTP itself, gRPC between replicas), as
# `python -m service` runs it; every Ray process a test starts inherits it.
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
