"""Schemathesis against the service's own /openapi.json: every operation, valid and invalid data.

    python -m loadtests.fuzz --max-examples 100                         # in process (EchoBackend)
    python -m loadtests.fuzz --url http://127.0.0.1:8000 --max-examples 100 [--api-key KEY]

Each operation gets up to `max_examples` generated cases per generation mode (positive: data the
schema allows; negative: data it forbids), derandomized unless `--seed` is given. Every response
must pass CHECKS: no 5xx, a documented status, content type, headers and body schema, and invalid
data rejected with a 4xx. Not checked: `positive_data_acceptance`, since the API refuses some
schema-valid requests on purpose with a 422 naming the field (empty texts, a prompt list of
length != 1, an unknown model or language pair, integral floats such as 2.0 for strict integer
fields, engine limits known only at run time). Exit status 1 when any case failed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup

log = logging.getLogger("loadtests.fuzz")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]


@dataclass
class FuzzReport:
    cases: int = 0
    seconds: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    per_operation: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # "<operation> <mode>: <status> <why>", one per failing case

    def summary(self) -> str:
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items()))
        return (f"{self.cases} cases on {len(self.per_operation)} operations in {self.seconds:.1f} s; "
                f"statuses {{{codes}}}; {len(self.failures)} failed")


class AsServer:
    """An ASGI app as a server runs it: an exception raised after the response was sent (Starlette
    re-raises after its 500) is logged, not raised into the test client."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = False

        async def watch(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if not started:
                raise
            log.debug("exception after the response was sent", exc_info=True)


# A request that breaks the schema must be refused; a 413 is that refusal too when the invalid value
# made the body larger than the service takes (schemathesis' default list has no 413).
REJECTIONS = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]


def _config() -> Any:
    return schemathesis.Config.from_dict({"checks": {"negative_data_rejection": {"expected-statuses": REJECTIONS}}})


def load_schema(url: str | None = None, app: Any = None) -> Any:
    """The schema of a live service (`url`) or of an ASGI app in process."""
    if url is not None:
        return schemathesis.openapi.from_url(url.rstrip("/") + "/openapi.json", config=_config())
    return schemathesis.openapi.from_asgi("/openapi.json", AsServer(app), config=_config())


def fuzz(schema: Any, max_examples: int, seed_value: int | None = None, headers: dict[str, str] | None = None,
         base_url: str | None = None, timeout_s: float = 30.0) -> FuzzReport:
    """Run every operation of `schema` in both generation modes; never raises for a failing case."""
    report, started = FuzzReport(), time.perf_counter()
    call_kwargs: dict[str, Any] = {"headers": headers or {}}
    if base_url is not None:
        call_kwargs.update(base_url=base_url.rstrip("/"), timeout=timeout_s)
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            run = _runner(report, f"{operation.label} {mode.value}", operation.label, call_kwargs, headers)
            test = settings(max_examples=max_examples, derandomize=seed_value is None, database=None,
                            deadline=None, suppress_health_check=list(HealthCheck),
                            phases=[Phase.explicit, Phase.generate])(
                given(case=operation.as_strategy(generation_mode=mode))(run))
            if seed_value is not None:
                test = seed(seed_value)(test)
            try:
                test()
            except Unsatisfiable:  # e.g. no invalid request exists for a GET without parameters
                log.info("%s %s: no cases to generate", operation.label, mode.value)
    report.seconds = time.perf_counter() - started
    return report


def _runner(report: FuzzReport, name: str, label: str, call_kwargs: dict[str, Any],
            headers: dict[str, str] | None) -> Any:
    """The test body for one operation and mode: call, count, check; a failure is recorded."""

    def run(case: Any) -> None:
        response = case.call(**call_kwargs)
        report.cases += 1
        report.per_operation[label] = report.per_operation.get(label, 0) + 1
        report.statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (FailureGroup, Exception) as e:  # a FailureGroup names every failed check
            report.failures.append(f"{name}: {response.status_code} {e}".strip()[:2000])

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running service; default: the API in process over a fake backend")
    parser.add_argument("--max-examples", type=int, default=100, help="cases per operation and generation mode")
    parser.add_argument("--seed", type=int, default=None, help="a Hypothesis seed (default: derandomized)")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer (in process: required)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    if args.url is None:
        from service.testing.fake_backend import fake_app

        logging.getLogger("service.http.errors").setLevel(logging.CRITICAL)  # 500s are counted, not logged twice
        app = fake_app({"api_keys": [args.api_key]} if args.api_key else None)
        report = fuzz(load_schema(app=app), args.max_examples, args.seed, headers)
    else:
        report = fuzz(load_schema(url=args.url), args.max_examples, args.seed, headers, base_url=args.url)
    for failure in report.failures:
        log.error("FAILED %s", failure)
    for label, n in report.per_operation.items():
        log.info("%-28s %5d cases", label, n)
    log.info("%s", report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
