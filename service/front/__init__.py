"""The service's HTTP front for `python -m service`: nginx on the service's port, in front of the
ingress replicas' own HTTP servers (throughput mode's direct ingress), Serve's proxy behind it as the
backup. It takes Serve's Python proxy off every request (docs/benchmarks.md, "Front and request
path"; docs/reliability.md) and, unlike Ray 2.60's HAProxy ingress, passes a client's hang-up on.

    config.py      the nginx configuration, rendered from plain values (pure)
    targets.py     the ingress replicas' addresses, from Serve's controller
    supervisor.py  runs nginx, reloads it when the targets change, restarts it if it dies
    answers.py     counts the answers nginx gives itself;  launch.py  which front, and starting it
Torch-free, FastAPI-free; Ray only through the controller handle the caller passes in.
"""
