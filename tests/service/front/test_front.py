"""The nginx front (service/front/): its configuration is valid nginx, its errors are our JSON, it
follows its targets (reload), falls back on Serve's proxy, passes a client's hang-up on and comes back
when nginx dies. Real nginx against stand-in upstreams on 127.0.0.1 (each answers its own name, so a
request that reached the wrong one fails); the service behind it is tested end to end by
tests/reliability/ (its fixture goes through this front) and tests/service/test_main_front.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from ray.serve._private.common import RequestProtocol
from ray.serve.schema import Target, TargetGroup

from service.errors import STATUS
from service.front.answers import ANSWER_TAG, MAX_PATHS, Answers
from service.front.config import ANSWERED, Address, FrontConfig, render_nginx, render_upstreams
from service.front.launch import choose_front
from service.front.ports import free_port
from service.front.supervisor import Front, FrontError
from service.front.targets import http_targets
from service.ray_env import HA_PROXY, THROUGHPUT
from service.telemetry.front_answers import FrontAnswersCollector, answers_file, load_totals
from service.testing.cluster import ROOT
from tests.service.front_checks import nginx_or_skip

LOCAL = "127.0.0.1"


class Named(ThreadingHTTPServer):
    """An upstream that answers every request with its name; `hold` makes POST /hold wait for the
    client (through nginx) to go away, and records that it did."""

    daemon_threads = True

    def __init__(self, name: str) -> None:
        self.name, self.hung_up = name, threading.Event()
        self.connections: list[socket.socket] = []
        self.posts = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                server.connections.append(self.connection)

            def do_GET(self) -> None:
                if self.path == "/slow":
                    time.sleep(0.5)
                body = name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.posts += 1
                if self.path == "/close":  # read the request, then die without answering
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.path == "/hold":  # answer nothing; EOF on the connection = the front hung up
                    self.connection.settimeout(10)
                    if self.connection.recv(1) == b"":
                        server.hung_up.set()
                    self.close_connection = True
                    return
                self.do_GET()

            def log_message(self, *args: object) -> None:
                pass

        server = self
        super().__init__((LOCAL, free_port()), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> Address:
        return Address(LOCAL, self.server_address[1])

    def close(self) -> None:
        """As a killed process: the port refuses, and the connections kept alive to it break."""
        self.shutdown()
        self.server_close()
        for c in self.connections:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def nginx() -> str:
    return nginx_or_skip()


@pytest.fixture
def upstreams() -> Iterator[dict[str, Named]]:
    servers = {name: Named(name) for name in ("a", "b", "serve")}
    yield servers
    for s in servers.values():
        s.close()


def front(nginx: str, tmp_path: Path, targets: list[Address], backup: Address, max_body: int = 1 << 20,
          answers: Answers | None = None) -> Front:
    cfg = FrontConfig(Address(LOCAL, free_port()), backup, tmp_path / "run", max_body, retry_after_s=2)
    return Front(cfg, lambda: tuple(targets), nginx, poll_s=0.1, answers=answers)


def answered_by(url: str, name: str, within_s: float = 5.0) -> float:
    """Seconds until GET url answers `name`; AssertionError naming the last answer otherwise."""
    started, last = time.monotonic(), None
    while time.monotonic() - started < within_s:
        r = httpx.get(url + "/x", timeout=2)
        last = (r.status_code, r.text[:80])
        if last == (200, name):
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"not answered by {name} within {within_s} s; last {last}")


def only(url: str, name: str, n: int = 20) -> None:
    """The next n requests all answered by `name` (the backup takes none while a target lives)."""
    assert {httpx.get(url + "/x", timeout=2).text for _ in range(n)} == {name}


def test_the_rendered_configuration_is_valid_nginx(nginx: str, tmp_path: Path) -> None:
    (tmp_path / "upstreams.conf").write_text(render_upstreams([], Address(LOCAL, 8001)))
    for host in ("0.0.0.0", "::"):
        cfg = FrontConfig(Address(host, 8000), Address(LOCAL, 8001), tmp_path, 1 << 20, 1)
        (tmp_path / "nginx.conf").write_text(render_nginx(cfg))
        out = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", "stderr"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    assert "listen [::]:8000 backlog=4096 ipv6only=off;" in render_nginx(cfg)  # IPv4 too, as Serve's `::`
    for targets in ([], [Address("10.0.0.2", 30000), Address("10.0.0.3", 30001)]):
        (tmp_path / "upstreams.conf").write_text(render_upstreams(targets, cfg.backup))
        out = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", "stderr"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_upstreams_list_each_target_once_and_serve_as_the_backup() -> None:
    backup = Address(LOCAL, 8001)
    both = render_upstreams([Address(LOCAL, 30001), Address(LOCAL, 30000), Address(LOCAL, 30001)], backup)
    assert both.count("server 127.0.0.1:30001 ") == 1 and "server 127.0.0.1:8001 max_fails=0 backup;" in both
    alone = render_upstreams([backup], backup)  # no ingress replica: Serve reports its proxy as the target
    assert alone.count("server ") == 1 and "server 127.0.0.1:8001 max_fails=0;" in alone


def test_targets_are_the_http_group_of_our_route() -> None:
    def group(protocol: RequestProtocol, prefix: str, *ports: int) -> TargetGroup:
        return TargetGroup(protocol=protocol, route_prefix=prefix,
                           targets=[Target(ip="10.0.0.5", port=p, instance_id=str(p), name=f"r{p}") for p in ports])

    groups = [group(RequestProtocol.HTTP, "/", 30001, 30000), group(RequestProtocol.GRPC, "/", 40000),
              group(RequestProtocol.HTTP, "/other", 30002)]
    assert http_targets(groups) == (Address("10.0.0.5", 30000), Address("10.0.0.5", 30001))
    assert http_targets(groups, host=LOCAL) == (Address(LOCAL, 30000), Address(LOCAL, 30001))
    assert http_targets(groups, "/other") == (Address("10.0.0.5", 30002),)


def test_choose_front(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_front("serve", {}) is None
    monkeypatch.setattr("service.front.launch.nginx_binary", lambda: "/usr/sbin/nginx")
    assert choose_front("auto", {}) == "/usr/sbin/nginx"
    assert choose_front("auto", {HA_PROXY: "1"}) is None  # Ray's HAProxy already fronts the port
    assert choose_front("auto", {THROUGHPUT: "0"}) is None  # no direct ingress to go to
    with pytest.raises(ValueError, match="direct ingress"):
        choose_front("nginx", {THROUGHPUT: "0"})
    with pytest.raises(ValueError, match="exclude each other"):
        choose_front("nginx", {HA_PROXY: "1"})
    monkeypatch.setattr("service.front.launch.nginx_binary", lambda: None)
    assert choose_front("auto", {}) is None
    with pytest.raises(ValueError, match="no nginx binary"):
        choose_front("nginx", {})
    with pytest.raises(ValueError, match="must be one of"):
        choose_front("haproxy", {})


def test_the_front_follows_its_targets_and_falls_back_on_serves_proxy(
        nginx: str, tmp_path: Path, upstreams: dict[str, Named]) -> None:
    targets = [upstreams["a"].address]
    with front(nginx, tmp_path, targets, upstreams["serve"].address) as f:
        answered_by(f.url, "a", within_s=0.5)
        only(f.url, "a")
        targets[:] = [upstreams["b"].address]  # the ingress replica replaced: another port
        assert answered_by(f.url, "b") < 2.0 and f.reloads == 1
        time.sleep(0.3)  # the old worker may accept for a moment after a reload (the old replica still drains)
        only(f.url, "b")
        upstreams["b"].close()  # gone before the next poll: its port refuses, Serve's proxy answers
        answered_by(f.url, "serve", within_s=0.5)
        targets[:] = []  # no replica running: everything to Serve's proxy
        answered_by(f.url, "serve")


def test_errors_nginx_answers_itself_are_our_json(nginx: str, tmp_path: Path) -> None:
    dead = Address(LOCAL, free_port())  # nothing listens: no upstream at all
    with front(nginx, tmp_path, [dead], dead, max_body=1000) as f:
        r = httpx.post(f.url + "/v1/classify", json={"inputs": "x"}, headers={"X-Request-ID": "mine"})
        assert r.status_code == 503 and r.headers["content-type"] == "application/json"
        assert r.json()["error"]["type"] == "model_not_ready" and r.headers["retry-after"] == "2"
        assert r.headers.get_list("x-request-id") == ["mine"]  # the client's id, to find it in its logs
        fresh = httpx.get(f.url + "/x", headers={"X-Request-ID": "<bad id>"}).headers.get_list("x-request-id")
        assert len(fresh) == 1 and fresh[0] != "<bad id>"
        big = httpx.post(f.url + "/v1/classify", content=b"x" * 2000, headers={"content-type": "application/json"})
        assert big.status_code == 413 == STATUS[big.json()["error"]["type"]]
        assert "1000 bytes" in big.json()["error"]["message"] and "retry-after" not in big.headers
        for raw, status in ((b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
                             400),
                            (b"GET /x HTTP/1.1\r\nHost: a\r\nAuthorization: " + b"t" * 70_000 + b"\r\n\r\n", 431)):
            head, body = raw_request(f.cfg.listen, raw)
            assert head.startswith(f"HTTP/1.1 {status} ".encode()), head[:60]
            assert b"content-type: application/json" in head.lower(), head
            assert "error" in json.loads(body), body
        # a long bearer token still reaches the service
        assert httpx.get(f.url + "/x", headers={"Authorization": "Bearer " + "t" * 30_000}).status_code == 503


def test_the_front_counts_its_own_answers_for_metrics(nginx: str, tmp_path: Path,
                                                      upstreams: dict[str, Named]) -> None:
    """What nginx answers itself never reaches the ingress's metrics: the front counts it by path and
    status into the metrics directory, where /metrics reads it (paths the API lacks: "other");
    what an upstream answered is not counted there."""
    node = tmp_path / "metrics" / "node-1"
    dead = Address(LOCAL, free_port())
    with front(nginx, tmp_path, [upstreams["a"].address], dead, max_body=1000,
               answers=Answers(answers_file(node, 7))) as f:
        assert httpx.post(f.url + "/v1/classify", json={"inputs": "x"}).text == "a"  # the upstream's answer
        upstreams["a"].close()  # now no upstream is reachable
        for _ in range(2):
            assert httpx.post(f.url + "/v1/classify", json={"inputs": "x"}).status_code == 503
        assert httpx.get(f.url + "/elsewhere?q=1").status_code == 503
        assert httpx.post(f.url + "/v1/classify", content=b"x" * 2000).status_code == 413
        want = {("/v1/classify", 503): 2, ("/elsewhere", 503): 1, ("/v1/classify", 413): 1}
        wait_until(lambda: f.answers.totals() == want)  # nginx logs after it answered; a thread reads the lines
        assert f.answers.totals() == want
        wait_until(lambda: load_totals(answers_file(node, 7)) == want)  # written at the next poll
        assert load_totals(answers_file(node, 7)) == want
    collector = FrontAnswersCollector(node, "ts_front_answers", "help", lambda: {"/v1/classify"})
    samples = {(s.labels["endpoint"], s.labels["status"]): s.value for m in collector.collect() for s in m.samples}
    assert samples == {("/v1/classify", "503"): 2, ("other", "503"): 1, ("/v1/classify", "413"): 1}


def test_answers_keep_a_bounded_number_of_paths() -> None:
    answers = Answers()
    answers.read([f"{ANSWER_TAG} 503 /p{i}\n".encode() for i in range(MAX_PATHS + 10)] + [b"noise\n", b"ts-answer x /y\n"])
    totals = answers.totals()
    assert len(totals) == MAX_PATHS + 1 and totals[("", 503)] == 10  # past the bound: "other" at /metrics
    assert sum(totals.values()) == MAX_PATHS + 10


def test_the_statuses_counted_from_the_start_are_those_nginx_answers(tmp_path: Path) -> None:
    """ANSWERED, exported at 0 from the front's start, is exactly the set of statuses the rendered
    configuration makes nginx answer itself (each `return <status>` of its error locations)."""
    cfg = FrontConfig(Address(LOCAL, 8000), Address(LOCAL, 8001), tmp_path, 1000, retry_after_s=2)
    returned = {int(code) for code in re.findall(r"^\s*return (\d{3}) ", render_nginx(cfg), re.MULTILINE)}
    assert returned == set(ANSWERED) and {413, 503} <= returned


def test_a_started_front_exports_each_status_it_can_answer_at_0(nginx: str, tmp_path: Path) -> None:
    """Before nginx answered anything, a front's file already holds each of ANSWERED at 0 under the
    path "" (the endpoint "other"), so the node's /metrics has the series from its first scrape;
    a node without a front has no file and no series. A real answer adds to the zeros."""
    node = tmp_path / "metrics" / "node-1"
    collector = FrontAnswersCollector(node, "ts_front_answers", "help", lambda: {"/v1/classify"})
    node.mkdir(parents=True)
    assert list(collector.collect()) == []  # no front on this node

    def samples() -> dict[tuple[str, str], float]:
        return {(s.labels["endpoint"], s.labels["status"]): s.value for m in collector.collect() for s in m.samples}

    dead = Address(LOCAL, free_port())
    zeros = {("other", str(status)): 0.0 for status in ANSWERED}
    with front(nginx, tmp_path, [dead], dead, answers=Answers(answers_file(node, 7), ANSWERED)) as f:
        assert load_totals(answers_file(node, 7)) == {("", status): 0 for status in ANSWERED}  # at start()
        assert samples() == zeros
        assert httpx.post(f.url + "/v1/classify", json={"inputs": "x"}).status_code == 503
        wait_until(lambda: samples() == {**zeros, ("/v1/classify", "503"): 1.0})
    assert samples() == {**zeros, ("/v1/classify", "503"): 1.0}


def wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Until check() holds or `timeout_s` passed (the caller asserts what it waited for)."""
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


def raw_request(address: Address, raw: bytes) -> tuple[bytes, bytes]:
    """Send raw bytes, read the whole answer (the server closes, or 2 s pass): (head, body)."""
    with socket.create_connection((address.host, address.port), timeout=2) as s:
        s.sendall(raw)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: (\d+)", head)
                if length and len(body) >= int(length.group(1)):
                    break
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def test_a_request_sent_to_an_upstream_is_never_sent_again(nginx: str, tmp_path: Path,
                                                           upstreams: dict[str, Named]) -> None:
    """An ingress that dies with the request: our 503 to the client, never the same POST to the backup
    (a model must not run a request twice)."""
    with front(nginx, tmp_path, [upstreams["a"].address], upstreams["serve"].address) as f:
        r = httpx.post(f.url + "/close", json={"inputs": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "model_not_ready"
        assert (upstreams["a"].posts, upstreams["serve"].posts) == (1, 0)


def test_a_port_taken_by_another_process_is_an_error(nginx: str, tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind((LOCAL, 0))
        squatter.listen()
        cfg = FrontConfig(Address(LOCAL, squatter.getsockname()[1]), Address(LOCAL, 9), tmp_path, 1000, 1)
        with pytest.raises(FrontError, match="did not start"):
            Front(cfg, lambda: (), nginx, start_timeout_s=5).start()


def test_a_client_that_hangs_up_is_passed_on(nginx: str, tmp_path: Path, upstreams: dict[str, Named]) -> None:
    with front(nginx, tmp_path, [upstreams["a"].address], upstreams["serve"].address) as f:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f.url + "/hold", content=b"{}", timeout=0.5)
        assert upstreams["a"].hung_up.wait(2.0), "the upstream never saw the client leave"


def test_nginx_that_dies_is_started_again(nginx: str, tmp_path: Path, upstreams: dict[str, Named]) -> None:
    with front(nginx, tmp_path, [upstreams["a"].address], upstreams["serve"].address) as f:
        first = f.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (f.restarts == 0 or f.pid == first) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f.restarts == 1 and f.pid != first
        answered_by(f.url, "a", within_s=1.0)
        slow: list[httpx.Response] = []
        ask = threading.Thread(target=lambda: slow.append(httpx.get(f.url + "/slow", timeout=5)))
        ask.start()
        time.sleep(0.2)
        f.stop()  # graceful, also for the nginx the follower thread started
        ask.join()
        assert slow and slow[0].text == "a"
    with socket.socket() as s:  # stopped: nothing listens on the front's port any more
        assert s.connect_ex((LOCAL, f.cfg.listen.port)) != 0


def test_a_front_that_cannot_start_nginx_again_says_it_failed(nginx: str, tmp_path: Path,
                                                              upstreams: dict[str, Named]) -> None:
    """`python -m service` stops (exit 1) when `failed` is set, rather than serve nothing on its port."""
    cfg = FrontConfig(Address(LOCAL, free_port()), upstreams["serve"].address, tmp_path, 1000, 1)
    with Front(cfg, lambda: (), nginx, poll_s=0.1, max_failures=2) as f:
        assert f.pid is not None
        (tmp_path / "nginx.conf").write_text("broken;\n")  # every start from now on fails at once
        os.kill(f.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while f.failed is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f.failed is not None and "2 times in a row" in f.failed and f.restarts == 0


def test_nginx_goes_when_the_process_that_started_it_is_killed(nginx: str, tmp_path: Path) -> None:
    """An orphaned nginx would hold the service's port against the next start."""
    port = free_port()
    code = ("import sys, time\nfrom pathlib import Path\nfrom service.front.config import Address, FrontConfig\n"
            "from service.front.supervisor import Front\n"
            f"cfg = FrontConfig(Address('127.0.0.1', {port}), Address('127.0.0.1', 9), Path({str(tmp_path)!r}), 1000, 1)\n"
            f"Front(cfg, lambda: (), {nginx!r}).start()\nprint('up', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        with socket.socket() as s:
            assert s.connect_ex((LOCAL, port)) == 0
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex((LOCAL, port)) != 0:
                    return
            time.sleep(0.05)
        raise AssertionError("nginx still listens after the process that started it was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
