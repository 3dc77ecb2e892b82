"""One system under test as a child process: start it in its own process group, wait until its
GET /readyz answers 200, stop it (SIGTERM to the leader for a clean Ray shutdown, then SIGKILL to
whatever is left of its group). Output goes to a log file whose tail is quoted when it fails.

Only the process group this module started is ever signalled (never `ray stop`, which would end
every Ray instance on the machine).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]


class StartError(RuntimeError):
    """The system exited or did not become ready; the message quotes its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """`with ServerProcess(...) as p: p.wait_ready(timeout)` runs it for the block."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        threads: int = 1,
    ) -> None:
        self.name, self.argv, self.port, self.log_path = name, list(argv), port, log_path
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        self.env = {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "wb")  # noqa: SIM115 (owned by the child; closed in stop)
        log.info("%s: starting (log %s)", self.name, self.log_path)
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._out = out

    def wait_ready(self, timeout_s: float, progress_s: float = 15.0, path: str = "/readyz") -> float:
        """Seconds until GET `path` answered 200. Raises StartError if it exits or times out."""
        assert self.proc is not None, "start() first"
        started = time.monotonic()
        next_note = started + progress_s
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise StartError(
                        f"{self.name} exited with code {code} before it was ready; its log ends:\n"
                        f"{log_tail(self.log_path)}"
                    )
                try:
                    if client.get(path).status_code == 200:
                        return time.monotonic() - started
                except httpx.HTTPError:
                    pass
                now = time.monotonic()
                if now - started > timeout_s:
                    raise StartError(
                        f"{self.name} was not ready after {timeout_s:g} s; its log ends:\n"
                        f"{log_tail(self.log_path)}"
                    )
                if now >= next_note:
                    log.info("%s: waiting for readiness (%.0f s)", self.name, now - started)
                    next_note = now + progress_s
                time.sleep(0.5)

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM to the leader (it shuts Ray down itself), then SIGKILL to the rest of its group."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s: still running %g s after SIGTERM; killing its process group", self.name, grace_s
                )
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # Ray workers, raylet, ... left behind
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._out.close()
        self.proc = None
        log.info("%s: stopped", self.name)

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
