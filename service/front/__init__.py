"""The service's HTTP front for `python -m service`: nginx on the service's port, in front of the
ingress replicas' own HTTP servers (Ray Serve throughput mode's direct ingress), with Serve's proxy
behind it as the backup.

Why: on 2 cores Serve's Python proxy costs ~5.8 ms of CPU a request. Through it a burst of 300
generations on the shipped models was refused in up to 0.8-1.4 s, where nginx on the ingress
replica's port refused them in 0.46-0.48 s and served twice the one-sentence embeddings
(docs/reliability.md). Unlike Ray 2.60's HAProxy ingress, nginx passes a client's hang-up on.

- `config.py`: the nginx configuration, rendered from plain values (pure);
- `targets.py`: the ingress replicas' addresses from Serve's controller;
- `supervisor.py`: runs nginx, follows the targets (reload on change), restarts nginx if it dies.

Torch-free, FastAPI-free; Ray only through the controller handle the caller passes in.
"""
