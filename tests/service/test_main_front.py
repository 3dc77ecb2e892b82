"""`python -m service` as a user runs it, with the nginx front (service/front/): the port answers
through nginx, nginx is the service's child and listens on the service's port only, and SIGTERM stops
everything (no nginx left behind, well within Serve's default 30 s ingress drain); what nginx answers
itself (a body over the limit) is in /metrics. Following a replaced
ingress replica is tested through the same front by tests/reliability/test_faults.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import yaml

from service.front.ports import free_port
from service.testing.cluster import ROOT, wait_for
from tests.service.front_checks import nginx_or_skip
from tests.service.test_generation_e2e import long_decoder

pytestmark = pytest.mark.e2e
TINY = {"name": "tiny-encoder", "tasks": ["classify", "embed"], "source": "tiny:encoder"}


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                addr, port = fields[1].split(":")
                ip = (".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(addr) == 8
                      else f"ipv6:{addr}")
                out.add((ip, int(port, 16)))
    return out


def children(pid: int, name: str) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-x", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def start_service(tmp_path: Path, port: int, args: dict[str, Any]) -> tuple[subprocess.Popen[bytes], IO[str]]:
    """`python -m service` on 127.0.0.1:`port` with a config of one application with `args`, in a
    session of its own (no TS_* or RAY_SERVE_* variables of ours); its output goes to the log returned."""
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "default", "import_path": "service.app:build_app", "route_prefix": "/",
                          "args": args}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TS_", "RAY_SERVE_"))}
    log = (tmp_path / "service.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "service", "--config", str(config), "--num-cpus", "2"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def test_python_m_service_serves_through_nginx_and_stops_clean(tmp_path: Path) -> None:
    nginx_or_skip()
    port = free_port()
    proc, log = start_service(tmp_path, port, {"device": "cpu", "deployments": {"encoder": {
        "model": TINY, "num_cpus": 0, "torch_threads": 1}}})
    try:
        url = f"http://127.0.0.1:{port}"
        ready = wait_for(url, "/readyz", 200, timeout_s=120)
        assert ready.headers["server"] == "nginx"
        r = httpx.post(url + "/v1/classify", json={"inputs": ["good", "bad"]}, timeout=10)
        assert r.status_code == 200 and len(r.json()["results"]) == 2
        # a body over the limit: nginx answers it, the ingress never sees it; /metrics still counts it
        big = httpx.post(url + "/v1/classify", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
        wanted = 'transformer_serve_front_answers_total{endpoint="/v1/classify",status="413"} 1.0'
        deadline = time.monotonic() + 10
        while wanted not in (scrape := httpx.get(url + "/metrics", timeout=10).text):
            assert time.monotonic() < deadline, [line for line in scrape.splitlines() if "front" in line]
            time.sleep(0.2)
        masters = children(proc.pid, "nginx")
        assert len(masters) == 1, "nginx is not the service's child"
        nginx = masters + children(masters[0], "nginx")
        ours = {p for pid in nginx for p in listening(pid)}
        assert ours == {("127.0.0.1", port)}, ours
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=25) == 0
        stopped_s = time.monotonic() - started
        assert stopped_s < 20, stopped_s  # ~7 s here; with Serve's 30 s drain it took 30 s more
        assert not any(Path(f"/proc/{pid}").exists() for pid in nginx)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_sigterm_lets_running_streams_finish_before_the_service_exits(tmp_path: Path) -> None:
    """SIGTERM: nginx stops listening, the streams it holds finish (the ingress's grace: the longest
    drain_grace_s + 5 s), then Serve's replicas stop and the process exits 0."""
    nginx_or_skip()
    port = free_port()
    # wide enough that 2,000 tokens take ~10 s on one thread (~5 ms a step whatever the per-step overhead):
    # well past nginx's default 5 s stop
    slow = long_decoder(tmp_path / "slow", d_model=512, d_ff=2048, n_layers=6)
    model = {"name": "slow", "tasks": ["generate"], "source": f"dir:{slow}"}
    proc, log = start_service(tmp_path, port, {"device": "cpu", "request_timeout_s": 120, "deployments": {
        "generator": {"model": model, "num_cpus": 0, "torch_threads": 1, "drain_grace_s": 60,
                      "engine": {"max_running": 4, "max_total_tokens": 4096, "max_new_tokens": 4000}}}})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(url, "/readyz", 200, timeout_s=120)
        tokens, finish, started, stopped_at = 0, None, time.monotonic(), None
        with httpx.stream("POST", url + "/v1/generate", timeout=120, json={
                "prompt": "keep going", "max_new_tokens": 2000, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if stopped_at is None and line.startswith("data: "):  # streaming: stop the service now
                    proc.send_signal(signal.SIGTERM)
                    stopped_at = time.monotonic()
                if line.startswith("data: {") and '"finish_reason"' in line:
                    event = json.loads(line[6:])
                    finish, tokens = event["finish_reason"], event["usage"]["completion_tokens"]
        assert stopped_at is not None and (finish, tokens) == ("length", 2000)
        streamed_after_s = time.monotonic() - stopped_at
        assert streamed_after_s > 5, f"the stream ended {streamed_after_s:.1f} s after SIGTERM: too short to tell"
        assert proc.wait(timeout=60) == 0
        with socket.socket() as s:  # nothing listens any more
            assert s.connect_ex(("127.0.0.1", port)) != 0
        assert time.monotonic() - started < 120
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
