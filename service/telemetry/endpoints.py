"""The `endpoint` label of the service's metrics: a route of the API, or "other" for any path the API
does not have (bounded cardinality). The ingress's middleware (service/http/observability.py) and the
front's answers (front_answers.py) label requests the same way."""

from __future__ import annotations

from collections.abc import Collection

OTHER = "other"
API_PREFIX = "/v1/"  # the routes clients call (the others: health, metrics, docs)


def endpoint_label(path: str, endpoints: Collection[str]) -> str:
    """`path` when it is one of the API's `endpoints`, else OTHER."""
    return path if path in endpoints else OTHER


def is_api(endpoint: str) -> bool:
    """Whether `endpoint` (a label) is a route clients call: its refusals are counted, its counters
    exported from the start."""
    return endpoint.startswith(API_PREFIX)
