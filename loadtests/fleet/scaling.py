"""A generator fleet through a load step, a rolling update and a downscale, with streams running.

    python -m loadtests.fleet.scaling            # = make bench-fleet-scaling, about 8 min on 2 cores

A local Ray + Serve serves the shipped generator (deploy/serve_config.yaml: its model, engine,
autoscaling policy and delays, except `--downscale-delay`, 300 s shipped) on one-CPU replicas,
1..2 of them. Closed-loop clients stream chat completions (`--tokens` each):
1. `--low` clients for `--warm` s;
2. the step: `--high` clients; Serve's replica states are polled: when a second replica was asked
   for (STARTING) and when it ran, after the step; `--hold` s more;
3. a rolling update (the app deployed again with a changed argument: every replica replaced) under
   the same load; `--hold` s after Serve reports it done;
4. `--low` clients again until Serve is back to one replica (the other drains), `--hold` s more.
Per phase: requests, failed (not 200), 504s, truncated streams (ended without their finish), output
tokens/s. Prints a table; exit status 1 when a request failed or a stream was truncated.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from ray import serve

from .affinity import app_args as shipped_generator

APP = "fleet"


@dataclass
class Outcome:
    phase: str
    status: int
    tokens: int
    whole: bool  # the stream ended with its finish_reason and [DONE]


@dataclass
class Load:
    """Closed-loop streaming clients; `clients` can change while it runs."""

    url: str
    tokens: int
    phase: str = "warm"
    clients: int = 0
    marks: list[tuple[str, float]] = field(default_factory=list)  # (phase, when it began)
    outcomes: list[Outcome] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def begin(self, phase: str, clients: int) -> None:
        self.phase = phase
        self.marks.append((phase, time.monotonic()))
        self.set_clients(clients)

    def seconds(self) -> dict[str, float]:
        """Each phase's duration (the last one's until now)."""
        ends = [t for _, t in self.marks[1:]] + [time.monotonic()]
        return {phase: end - t for (phase, t), end in zip(self.marks, ends, strict=True)}

    def set_clients(self, n: int) -> None:
        self.clients = n
        while len(self._threads) < n:
            t = threading.Thread(target=self._client, args=(len(self._threads),), daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)

    def _client(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=300) as client:
            while not self._stop.is_set():
                if i >= self.clients:  # parked while fewer clients are asked for
                    time.sleep(0.2)
                    continue
                self.outcomes.append(self._one(client, i))

    def _one(self, client: httpx.Client, i: int) -> Outcome:
        phase, tokens, finished, done = self.phase, 0, False, False
        body = {"messages": [{"role": "user", "content": f"Client {i}: tell me a long story about a lighthouse."}],
                "max_tokens": self.tokens, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return Outcome(phase, r.status_code, 0, False)
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            break
                        for choice in event.get("choices", []):
                            finished = finished or choice.get("finish_reason") is not None
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
                return Outcome(phase, 200, tokens, finished and done)
        except httpx.HTTPError:
            return Outcome(phase, 0, tokens, False)


def states() -> dict[str, int]:
    status = serve.status().applications.get(APP)
    if status is None or "generator" not in status.deployments:
        return {}
    return {str(getattr(s, "value", s)): n for s, n in status.deployments["generator"].replica_states.items()}


def wait_until(predicate: Any, timeout_s: float) -> float | None:
    """Seconds until predicate(states()) held (polled every 0.5 s), None past timeout_s."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate(states()):
            return time.monotonic() - started
        time.sleep(0.5)
    return None


def app(args: argparse.Namespace, version: int) -> dict[str, Any]:
    """The shipped generator, autoscaled 1..2 with the shipped policy; `version` changes an argument."""
    spec = shipped_generator("prefix", 1, {"min_replicas": 1, "max_replicas": 2,
                                           "downscale_delay_s": args.downscale_delay})
    spec["retry_after_s"] = 1 + version  # a changed argument: a new version of every deployment
    return spec


def run(args: argparse.Namespace) -> dict[str, Any]:
    from service.testing.cluster import deploy, local_cluster, wait_for

    report: dict[str, Any] = {}
    with local_cluster(num_cpus=3) as url:
        deploy(app(args, 0), name=APP)
        wait_for(url, "/readyz", 200, timeout_s=900)
        load = Load(url, args.tokens)
        load.begin("warm", args.low)
        time.sleep(args.warm)
        load.begin("step", args.high)
        report["asked_s"] = wait_until(lambda s: s.get("STARTING", 0) + s.get("RUNNING", 0) >= 2, 300)
        report["running_s"] = (report["asked_s"] or 0) + (wait_until(lambda s: s.get("RUNNING", 0) >= 2, 600) or 0)
        time.sleep(args.hold)
        load.begin("update", args.high)
        started = time.monotonic()
        deploy(app(args, 1), name=APP)  # returns when Serve reports the new version running
        report["update_s"] = time.monotonic() - started
        time.sleep(args.hold)
        load.begin("downscale", args.low)
        report["down_s"] = wait_until(lambda s: s.get("RUNNING", 0) == 1 and not s.get("STOPPING"), 900)
        time.sleep(args.hold)
        report["seconds"] = load.seconds()
        load.stop()
    report["outcomes"] = load.outcomes
    return report


def table(report: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["| phase | clients | requests | failed | 504 | truncated | output tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    clients = {"warm": args.low, "step": args.high, "update": args.high, "downscale": args.low}
    for phase, seconds in report["seconds"].items():
        rows = [o for o in report["outcomes"] if o.phase == phase]
        lines.append(f"| {phase} | {clients[phase]} | {len(rows)} | {sum(o.status != 200 for o in rows)} | "
                     f"{sum(o.status == 504 for o in rows)} | {sum(o.status == 200 and not o.whole for o in rows)} | "
                     f"{sum(o.tokens for o in rows) / seconds:.1f} |")

    def s(key: str) -> str:
        return "never" if report.get(key) is None else f"{report[key]:.1f} s"

    lines.append(f"\nStep {args.low} -> {args.high} streams: a second replica asked for after {s('asked_s')}, "
                 f"running after {s('running_s')}; the rolling update took {s('update_s')}; one replica again "
                 f"{s('down_s')} after the load fell (downscale_delay_s {args.downscale_delay:g})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.fleet.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--low", type=int, default=4)
    p.add_argument("--high", type=int, default=48)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--warm", type=float, default=20.0)
    p.add_argument("--hold", type=float, default=20.0)
    p.add_argument("--downscale-delay", type=float, default=30.0)
    args = p.parse_args(argv)
    report = run(args)
    print(table(report, args))
    bad = [o for o in report["outcomes"] if o.status != 200 or not o.whole]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
