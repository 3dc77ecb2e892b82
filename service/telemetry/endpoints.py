"""The `endpoint` label of the service's metrics: a route of the API, or "other" for any path the API
does not have (bounded cardinality). The ingress's middleware (service/http/observability.py) and the
front's answers (front_answers.py) label requests the same way."""

from __future__ import annotations

from collections.abc import Collection

OTHER = "other"


def endpoint_label(path: str, endpoints: Collection[str]) -> str:
    """`path` when it is one of the API's `endpoints`, else OTHER."""
    return path if path in endpoints else OTHER
