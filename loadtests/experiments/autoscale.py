"""Autoscaling, shown working: one deployment scales from 1 replica to 2 under load and back to 1 after it,
and every request meanwhile gets the answer the same text gets alone.

    python -m loadtests.experiments.autoscale --out docs/img/autoscaling.png    # about a minute on 2 cores

The scenario (also run by tests/deploy/test_autoscaling.py, on the same functions):
1. a local Ray with Serve's autoscaling metrics pushed every 0.5 s (`cluster_env`), and the app with one
   tiny encoder deployment (`app_args`): 0.5 CPU per replica, autoscaling 1..2 replicas at
   `target_ongoing_requests` 2 with second-scale delays. Its batcher waits `max_wait_ms` for company
   and batches are never full, so each request stays that long in its replica: a stand-in for model
   time that makes "ongoing requests" follow the number of clients on any machine;
2. the reference answer of every text, asked alone;
3. load: `concurrency` closed-loop clients (ongoing requests well above target) until Serve reports
   2 running replicas, then `hold_s` more;
4. trickle: one client with pauses (below target) until Serve reports 1 running replica again, then
   `tail_s` more. Every answer is compared with its reference (allclose) all along.

The timeline (replicas from `serve.status()`, latency p50/p99 per second) is plotted by `plot`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from service.testing.cluster import local_cluster

log = logging.getLogger("loadtests.experiments.autoscale")
ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = "encoder"
TEXTS = tuple(f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 5)
              for i in range(12))


@dataclass(frozen=True)
class Scenario:
    """The knobs of the run; the defaults keep it under about a minute."""

    max_replicas: int = 2
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 3.0
    look_back_period_s: float = 2.0  # Serve averages ongoing requests over this window
    num_cpus: float = 0.5  # per replica (fractional: both replicas fit on one core)
    max_wait_ms: float = 100.0  # how long each request stays in its replica (see the module docstring)
    concurrency: int = 8  # clients during the load
    trickle_pause_s: float = 0.2  # the one client's pause between requests after the load
    hold_s: float = 4.0  # load kept on after the scale-up
    tail_s: float = 2.0  # trickle kept on after the scale-down
    phase_timeout_s: float = 45.0  # for each of scale-up and scale-down
    sample_every_s: float = 0.25


def cluster_env(s: Scenario) -> dict[str, str]:
    """Ray Serve reads these at start-up in its controller and replicas: autoscaling metrics every 0.5 s
    (the defaults push every 10 s, too slow for a test)."""
    return {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
            "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
            "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}


def app_args(s: Scenario) -> dict[str, Any]:
    """The service's settings (`Settings.build` args): one tiny encoder deployment, autoscaled."""
    model = {"name": "tiny-encoder", "tasks": ["classify", "embed"], "source": "tiny:encoder",
             "max_input_tokens": 256}
    return {
        "device": "cpu", "max_inputs": 8, "readiness_timeout_s": 1,
        "deployments": {DEPLOYMENT: {
            "model": model, "num_cpus": s.num_cpus,
            "autoscaling_config": {
                "min_replicas": 1, "max_replicas": s.max_replicas,
                "target_ongoing_requests": s.target_ongoing_requests,
                "upscale_delay_s": s.upscale_delay_s, "downscale_delay_s": s.downscale_delay_s,
                "look_back_period_s": s.look_back_period_s, "metrics_interval_s": 0.5,
            },
            "batching": {"max_batch_size": 64, "max_wait_ms": s.max_wait_ms, "max_batch_tokens": 16384,
                         "max_queued": 256},
        }},
    }


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the run started
    running: int  # replicas Serve reports RUNNING
    starting: int  # ... STARTING, UPDATING or RECOVERING
    stopping: int


@dataclass(frozen=True)
class Call:
    start: float
    end: float
    phase: str  # "load" or "trickle"
    status: int  # HTTP status; 0 when the request failed before a response
    correct: bool  # 200 and the same embedding as the text alone


@dataclass
class Timeline:
    scenario: Scenario
    samples: list[Sample] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    # load_start, scaled_up, load_stop, scaled_down, end
    events: dict[str, float] = field(default_factory=dict)

    def wrong(self) -> list[Call]:
        return [c for c in self.calls if not c.correct]

    def replicas(self) -> list[int]:
        return [s.running for s in self.samples]

    def calls_during(self, start: float, end: float) -> list[Call]:
        return [c for c in self.calls if c.end > start and c.start < end]

    def latency_windows(self, width_s: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Window centres, p50 and p99 (ms) of the calls that ended in each window (NaN where none did)."""
        end = self.events.get("end", max((c.end for c in self.calls), default=0.0))
        edges = np.arange(0.0, end + width_s, width_s)
        ends = np.array([c.end for c in self.calls])
        ms = np.array([(c.end - c.start) * 1000.0 for c in self.calls])
        p50, p99 = [], []
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            inside = ms[(ends >= lo) & (ends < hi)]
            p50.append(np.percentile(inside, 50) if inside.size else np.nan)
            p99.append(np.percentile(inside, 99) if inside.size else np.nan)
        return (edges[:-1] + edges[1:]) / 2, np.array(p50), np.array(p99)

    def summary(self) -> str:
        e = self.events
        return (f"{len(self.calls)} requests ({len(self.wrong())} wrong or failed); replicas "
                f"{min(self.replicas(), default=0)}..{max(self.replicas(), default=0)}; load at "
                f"{e.get('load_start', 0):.1f} s, 2 replicas at {e.get('scaled_up', float('nan')):.1f} s, "
                f"load off at {e.get('load_stop', float('nan')):.1f} s, 1 replica at "
                f"{e.get('scaled_down', float('nan')):.1f} s")


def replica_counts(app: str, deployment: str = DEPLOYMENT) -> tuple[int, int, int]:
    """(running, starting, stopping) replicas of a deployment from `serve.status()`; needs Ray."""
    from ray import serve

    states = serve.status().applications[app].deployments[deployment].replica_states
    count = lambda *names: sum(int(states.get(n, 0)) for n in names)  # noqa: E731
    return count("RUNNING"), count("STARTING", "UPDATING", "RECOVERING"), count("STOPPING")


def _embed(client: httpx.Client, text: str) -> tuple[int, np.ndarray | None]:
    try:
        r = client.post("/v1/embeddings", json={"input": text})
    except httpx.HTTPError:
        return 0, None
    if r.status_code != 200:
        return r.status_code, None
    return 200, np.asarray(r.json()["data"][0]["embedding"], dtype=np.float64)


def reference_answers(url: str, texts: Sequence[str] = TEXTS) -> list[np.ndarray]:
    """Each text's embedding asked alone, one request at a time (batches of one)."""
    refs = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for text in texts:
            status, vec = _embed(client, text)
            if vec is None:
                raise RuntimeError(f"reference request for {text[:20]!r}... answered {status}")
            refs.append(vec)
    return refs


class _Clients:
    """Closed-loop HTTP clients in threads, each sending texts round-robin and checking every answer."""

    def __init__(self, url: str, refs: Sequence[np.ndarray], timeline: Timeline,
                 clock: Callable[[], float]) -> None:
        self.url, self.refs, self.timeline, self.clock = url, refs, timeline, clock
        self.lock = threading.Lock()
        self.threads: list[tuple[threading.Thread, threading.Event]] = []

    def start(self, n: int, phase: str, pause_s: float = 0.0) -> None:
        for i in range(n):
            stop = threading.Event()
            thread = threading.Thread(target=self._loop, args=(i, phase, pause_s, stop), daemon=True,
                                      name=f"autoscale-{phase}-{i}")
            thread.start()
            self.threads.append((thread, stop))

    def stop_all(self) -> None:
        for _, stop in self.threads:
            stop.set()
        for thread, _ in self.threads:
            thread.join(timeout=60)
        self.threads = []

    def _loop(self, offset: int, phase: str, pause_s: float, stop: threading.Event) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            i = offset
            while not stop.is_set():
                k = i % len(TEXTS)
                started = self.clock()
                status, vec = _embed(client, TEXTS[k])
                correct = vec is not None and vec.shape == self.refs[k].shape and \
                    bool(np.allclose(vec, self.refs[k], rtol=1e-4, atol=1e-5))
                with self.lock:
                    self.timeline.calls.append(Call(started, self.clock(), phase, status, correct))
                i += 1
                if pause_s:
                    stop.wait(pause_s)


def _wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.1)


def run(url: str, app: str, s: Scenario = Scenario()) -> Timeline:
    """The load scenario against a deployed `app_args(s)` application; the caller holds the Ray connection.
    Raises TimeoutError when the deployment does not scale up (or down) within `phase_timeout_s`."""
    t0 = time.monotonic()
    clock = lambda: time.monotonic() - t0  # noqa: E731
    timeline = Timeline(s)
    refs = reference_answers(url)
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.is_set():
            try:
                timeline.samples.append(Sample(clock(), *replica_counts(app)))
            except Exception as e:  # a status call during a controller hiccup; the next one counts
                log.debug("serve.status() failed: %s", e)
            stop_sampling.wait(s.sample_every_s)

    sampler = threading.Thread(target=sample, daemon=True, name="autoscale-sampler")
    sampler.start()
    clients = _Clients(url, refs, timeline, clock)
    latest = lambda: timeline.samples[-1].running if timeline.samples else 0  # noqa: E731
    try:
        _wait_until(lambda: latest() == 1, s.phase_timeout_s, "one running replica before the load")
        timeline.events["load_start"] = clock()
        clients.start(s.concurrency, "load")
        _wait_until(lambda: latest() >= s.max_replicas, s.phase_timeout_s,
                    f"the scale-up to {s.max_replicas} replicas")
        timeline.events["scaled_up"] = clock()
        time.sleep(s.hold_s)
        # the load stops when the clients are told to: none sends again, and the replicas' ongoing
        # counts (what the autoscaler averages) fall as their last answers come back, which stop_all
        # waits for (stamped after it, a downscale 3.0 s after the load fell was measured as 2.9 s)
        timeline.events["load_stop"] = clock()
        clients.stop_all()
        clients.start(1, "trickle", pause_s=s.trickle_pause_s)
        _wait_until(lambda: latest() == 1, s.phase_timeout_s, "the scale-down to 1 replica")
        timeline.events["scaled_down"] = clock()
        _wait_until(lambda: timeline.samples[-1].stopping == 0, s.phase_timeout_s, "the old replica's stop")
        time.sleep(s.tail_s)
    finally:
        clients.stop_all()
        stop_sampling.set()
        sampler.join(timeout=10)
        timeline.events["end"] = clock()
    log.info("%s", timeline.summary())
    return timeline


def plot(timeline: Timeline, path: Path) -> None:
    """Replicas (running and starting) and latency p50/p99 per second over time, load phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in timeline.samples]
    fig, (ax_r, ax_l) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, height_ratios=[1, 1.3])
    ax_r.step(t, [s.running for s in timeline.samples], where="post", label="running", color="tab:blue")
    ax_r.step(t, [s.running + s.starting for s in timeline.samples], where="post", label="running + starting",
              color="tab:blue", linestyle=":", alpha=0.7)
    ax_r.set_ylabel("replicas")
    ax_r.set_yticks(range(0, timeline.scenario.max_replicas + 2))
    centres, p50, p99 = timeline.latency_windows()
    ax_l.plot(centres, p50, marker=".", label="p50")
    ax_l.plot(centres, p99, marker=".", label="p99")
    ax_l.set_ylabel("latency (ms)")
    ax_l.set_xlabel("time (s)")
    e = timeline.events
    for ax in (ax_r, ax_l):
        if "load_start" in e and "load_stop" in e:
            ax.axvspan(e["load_start"], e["load_stop"], color="tab:orange", alpha=0.12,
                       label=f"{timeline.scenario.concurrency} clients")
        if "load_stop" in e:
            ax.axvspan(e["load_stop"], e["end"], color="tab:green", alpha=0.08, label="1 client, pauses")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    s = timeline.scenario
    wrong = len(timeline.wrong())
    fig.suptitle(f"Ray Serve autoscaling: target {s.target_ongoing_requests:g} ongoing requests per replica, "
                 f"{len(timeline.calls)} requests, {wrong} wrong", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.experiments.autoscale", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs/img/autoscaling.png"), help="the PNG to write")
    p.add_argument("--concurrency", type=int, default=Scenario.concurrency)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ray import serve

    from service.app import build_app_from_settings
    from service.settings import Settings

    s = Scenario(concurrency=args.concurrency)
    app = "autoscale"
    with local_cluster(env=cluster_env(s)) as url:
        serve.run(build_app_from_settings(Settings.build(app_args(s), env={})), name=app, route_prefix="/")
        timeline = run(url, app, s)
    plot(timeline, args.out)
    log.info("wrote %s", args.out)
    return 1 if timeline.wrong() else 0


if __name__ == "__main__":
    sys.exit(main())
