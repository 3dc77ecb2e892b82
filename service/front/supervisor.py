"""Runs nginx as the service's front and keeps its upstreams on Serve's ingress replicas.

    with Front(cfg, targets=serve_targets(controller, host="127.0.0.1"), binary=nginx_binary()):
        ...   # clients connect to cfg.listen

nginx runs in the foreground as our child (`daemon off`), its error log on our stderr. A thread asks
for the targets every `poll_s`; on a change it rewrites upstreams.conf (atomically) and sends nginx
SIGHUP: new workers take the new upstreams, the old ones finish the requests they hold (a stream
keeps its connection). Until the reload a replaced replica's old port refuses connections and nginx
retries them on Serve's proxy (the backup, config.py). If nginx exits, it is started again.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from .answers import Answers
from .config import UPSTREAMS, Address, FrontConfig, render_nginx, render_upstreams

log = logging.getLogger(__name__)
Targets = Callable[[], tuple[Address, ...]]
PR_SET_PDEATHSIG = 1


class FrontError(RuntimeError):
    """nginx did not start (the message carries what it said)."""


def nginx_binary() -> str | None:
    """nginx on PATH, else Debian's /usr/sbin/nginx (not on a normal user's PATH), else None."""
    found = shutil.which("nginx")
    if found is None and os.access("/usr/sbin/nginx", os.X_OK):
        found = "/usr/sbin/nginx"
    return found


def _dies_with_us() -> Callable[[], None]:
    """A preexec_fn: in the child, before exec, SIGTERM to it when the thread that forked it exits
    (Linux prctl), and exit at once if we are gone already. prctl is looked up here, in the parent:
    loading a library after fork in a threaded process can deadlock."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def run() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return run


def _local(address: Address) -> Address:
    """Where this machine reaches a server listening on `address` (a wildcard host: loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(address.host, address.host)
    return Address(host, address.port)


def _connectable(address: Address) -> bool:
    local = _local(address)
    try:
        with socket.create_connection((local.host, local.port), timeout=0.5):
            return True
    except OSError:
        return False


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Front:
    def __init__(self, cfg: FrontConfig, targets: Targets, binary: str, poll_s: float = 0.5,
                 start_timeout_s: float = 10.0, max_failures: int = 5, answers: Answers | None = None) -> None:
        self.cfg, self.targets, self.binary = cfg, targets, binary
        self.answers = answers if answers is not None else Answers()  # nginx's own answers (answers.py)
        self.poll_s, self.start_timeout_s, self.max_failures = poll_s, start_timeout_s, max_failures
        self.current: tuple[Address, ...] = ()
        self.reloads = 0  # upstream changes applied
        self.restarts = 0  # nginx started again after it exited
        self.failed: str | None = None  # set when nginx could not be started again: the service should stop
        self._unread = 0  # failed target reads in a row
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # spawning and stopping exclude each other
        self._released = threading.Event()  # nginx stopped: the follower thread may end
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{_local(self.cfg.listen)}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> Front:
        run = self.cfg.run_dir
        run.mkdir(parents=True, exist_ok=True)
        run.chmod(0o755)  # nginx's workers (another user when started as root) create their temp dirs here
        _write(run / "nginx.conf", render_nginx(self.cfg))
        self.current = self._ask() or ()
        _write(run / UPSTREAMS, render_upstreams(self.current, self.cfg.backup))
        self.answers.write()  # the counts it starts from (its statuses at 0): /metrics knows this front at once
        self._spawn()
        self._thread = threading.Thread(target=self._follow, name="front", daemon=True)
        self._thread.start()
        log.info("front: nginx (pid %d) on %s -> %s, Serve's proxy %s as backup", self.pid, self.cfg.listen,
                 ", ".join(map(str, self.current)) or "(no replica yet)", self.cfg.backup)
        return self

    def _spawn(self) -> None:
        cmd = [self.binary, "-p", str(self.cfg.run_dir), "-c", str(self.cfg.run_dir / "nginx.conf"),
               "-e", "stderr", "-g", "daemon off;"]
        pid_file = self.cfg.run_dir / "nginx.pid"
        pid_file.unlink(missing_ok=True)
        # Its own process group, so that workers outliving a killed master (they keep the port) can be
        # killed with it; and SIGTERM to the master when this process dies, even by SIGKILL: an
        # orphaned nginx would hold the service's port against the next start.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_dies_with_us())
        deadline = time.monotonic() + self.start_timeout_s
        # nginx writes its pid file once its sockets are bound: a port that answers without it is
        # somebody else's (nginx itself retries the bind for ~2.5 s, then exits saying why)
        while not (_pid_in(pid_file) == self._proc.pid and _connectable(self.cfg.listen)):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._kill()
                said = self._proc.stderr.read().decode(errors="replace").strip() if self._proc.stderr else ""
                raise FrontError(f"nginx did not start on {self.cfg.listen}: {said or 'no output'}")
            time.sleep(0.02)
        threading.Thread(target=self._relay, args=(self._proc,), name="front-log", daemon=True).start()
        # its own answers, a line each on stdout: always read, as the error log
        threading.Thread(target=self.answers.read, args=(self._proc.stdout,), name="front-answers", daemon=True).start()

    @staticmethod
    def _relay(proc: subprocess.Popen[bytes], per_second: int = 20) -> None:
        """nginx's error log into ours, at most `per_second` lines a second (a client can make nginx
        log a line per request); the rest counted. Always read: a full pipe would stall nginx."""
        assert proc.stderr is not None
        window, shown, dropped = time.monotonic(), 0, 0
        for line in proc.stderr:
            now = time.monotonic()
            if now - window >= 1.0:
                if dropped:
                    log.warning("nginx: %d more lines in the last second not shown", dropped)
                window, shown, dropped = now, 0, 0
            if shown < per_second:
                shown += 1
                log.warning("nginx: %s", line.decode(errors="replace").rstrip())
            else:
                dropped += 1

    def _ask(self) -> tuple[Address, ...] | None:
        try:
            return self.targets()
        except Exception as e:  # the controller busy or restarting: keep the upstreams we have
            if self._unread == 0 or self._unread % 60 == 0:  # at the first failure, then every ~30 s
                log.warning("front: could not read Serve's targets (%s: %s); keeping %s", type(e).__name__, e,
                            ", ".join(map(str, self.current)) or "the backup")
            self._unread += 1
            return None

    def _follow(self) -> None:
        try:
            self._follow_until_stopped()
        finally:  # an nginx this thread started gets SIGTERM (PDEATHSIG) when it ends: wait for stop()
            self._released.wait()

    def _follow_until_stopped(self) -> None:
        failures = 0
        while not self._stop.wait(min(self.poll_s * 2 ** failures, 10.0)):
            try:
                self._step()
                failures = 0
            except Exception as e:  # nginx would not start again, or its files could not be written
                failures += 1
                log.error("front: %s (%d in a row)", e, failures)
                if failures >= self.max_failures:
                    self.failed = f"nginx failed {failures} times in a row; last: {e}"
                    log.error("front: giving up: %s", self.failed)
                    return

    def _step(self) -> None:
        assert self._proc is not None
        self.answers.write()
        if self._proc.poll() is not None:
            with self._lock:
                if self._stop.is_set():
                    return
                log.error("front: nginx exited (%s); starting it again", self._proc.returncode)
                self._kill_group()
                self._spawn()
                self.restarts += 1
            return
        targets = self._ask()
        if targets is not None:
            self._unread = 0
            if targets != self.current:
                self.apply(targets)

    def apply(self, targets: tuple[Address, ...]) -> None:
        """Point nginx at `targets` now (the follower thread calls this on every change)."""
        _write(self.cfg.run_dir / UPSTREAMS, render_upstreams(targets, self.cfg.backup))
        assert self._proc is not None
        self._proc.send_signal(signal.SIGHUP)
        log.info("front: upstreams %s -> %s", ", ".join(map(str, self.current)) or "-",
                 ", ".join(map(str, targets)) or "the backup only")
        self.current = targets
        self.reloads += 1

    def _kill_group(self) -> None:
        """SIGKILL whatever is left of nginx's process group (its master is gone)."""
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)

    def _kill(self, grace_s: float = 0.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGQUIT if grace_s else signal.SIGTERM)  # QUIT: finish open requests
            try:
                self._proc.wait(grace_s or 5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._kill_group()

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop following, then nginx: open requests get `grace_s` to finish. nginx is stopped before
        the follower thread ends: one it restarted would get SIGTERM (no grace) when that thread ends."""
        with self._lock:
            self._stop.set()
        self._kill(grace_s)
        self._released.set()
        if self._thread is not None:
            self._thread.join()
        self.answers.write()  # the answers of its last moments

    def __enter__(self) -> Front:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
