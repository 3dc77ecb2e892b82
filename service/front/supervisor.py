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


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started it exits (Linux prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _connectable(address: Address) -> bool:
    host = "127.0.0.1" if address.host in ("0.0.0.0", "") else "::1" if address.host == "::" else address.host
    try:
        with socket.create_connection((host, address.port), timeout=0.5):
            return True
    except OSError:
        return False


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Front:
    def __init__(self, cfg: FrontConfig, targets: Targets, binary: str, poll_s: float = 0.5,
                 start_timeout_s: float = 10.0) -> None:
        self.cfg, self.targets, self.binary = cfg, targets, binary
        self.poll_s, self.start_timeout_s = poll_s, start_timeout_s
        self.current: tuple[Address, ...] = ()
        self.reloads = 0  # upstream changes applied
        self.restarts = 0  # nginx started again after it exited
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.cfg.listen.host in ("0.0.0.0", "") else self.cfg.listen.host
        return f"http://{Address(host, self.cfg.listen.port)}"

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
        self._spawn()
        self._thread = threading.Thread(target=self._follow, name="front", daemon=True)
        self._thread.start()
        log.info("front: nginx (pid %d) on %s -> %s, Serve's proxy %s as backup", self.pid, self.cfg.listen,
                 ", ".join(map(str, self.current)) or "(no replica yet)", self.cfg.backup)
        return self

    def _spawn(self) -> None:
        cmd = [self.binary, "-p", str(self.cfg.run_dir), "-c", str(self.cfg.run_dir / "nginx.conf"),
               "-e", "stderr", "-g", "daemon off;"]
        # Its own process group, so that workers outliving a killed master (they keep the port) can be
        # killed with it; and SIGTERM to the master when this process dies, even by SIGKILL: an
        # orphaned nginx would hold the service's port against the next start.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.start_timeout_s
        while not _connectable(self.cfg.listen):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._kill()
                said = self._proc.stderr.read().decode(errors="replace").strip() if self._proc.stderr else ""
                raise FrontError(f"nginx did not start on {self.cfg.listen}: {said or 'no output'}")
            time.sleep(0.02)
        threading.Thread(target=self._relay, args=(self._proc,), name="front-log", daemon=True).start()

    @staticmethod
    def _relay(proc: subprocess.Popen[bytes]) -> None:
        """nginx's error log, line by line, into ours."""
        assert proc.stderr is not None
        for line in proc.stderr:
            log.warning("nginx: %s", line.decode(errors="replace").rstrip())

    def _ask(self) -> tuple[Address, ...] | None:
        try:
            return self.targets()
        except Exception as e:  # the controller busy or restarting: keep the upstreams we have
            log.warning("front: could not read Serve's targets (%s: %s); keeping %s", type(e).__name__, e,
                        ", ".join(map(str, self.current)) or "the backup")
            return None

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            assert self._proc is not None
            if self._proc.poll() is not None:
                log.error("front: nginx exited (%s); starting it again", self._proc.returncode)
                self._kill_group()
                try:
                    self._spawn()
                    self.restarts += 1
                except FrontError as e:
                    log.error("front: %s", e)
                continue
            targets = self._ask()
            if targets is not None and targets != self.current:
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
        """Stop following, then nginx: open requests get `grace_s` to finish."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._kill(grace_s)

    def __enter__(self) -> Front:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
