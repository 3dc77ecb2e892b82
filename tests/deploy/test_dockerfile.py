"""deploy/Dockerfile and .dockerignore, checked statically (no Docker engine here): variants, pins,
non-root user, weights baked in, a HEALTHCHECK that really fails on an unhealthy service, a CMD that
`python -m service` accepts, and a build context that holds everything the Dockerfile copies."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from models.zoo import CACHE_ENV
from service.__main__ import _parse

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return out


INSTR = instructions(DOCKERFILE.read_text())


def _all(word: str) -> list[str]:
    return [args for w, args in INSTR if w == word]


def _args() -> dict[str, str]:
    return dict(a.split("=", 1) if "=" in a else (a, "") for a in _all("ARG"))


def _index(word: str, pattern: str = "") -> int:
    return next(i for i, (w, a) in enumerate(INSTR) if w == word and re.search(pattern, a))


def test_variant_argument_selects_cpu_or_cuda_torch() -> None:
    args = _args()
    assert args["VARIANT"] == "cpu"
    (torch_run,) = [r for r in _all("RUN") if "torch==" in r]
    assert re.search(r"cpu\) index=cpu", torch_run)
    assert re.search(r"cuda\) index=\"\$\{CUDA_INDEX}\"", torch_run)
    assert "exit 1" in torch_run  # an unknown variant stops the build
    assert "download.pytorch.org/whl/${index}" in torch_run


def test_torch_and_everything_else_are_pinned() -> None:
    make_torch = re.search(r"^TORCH := torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert make_torch and pinned
    assert _args()["TORCH_VERSION"] == make_torch.group(1) == pinned.group(1) == "2.13.0"
    installs = [r for r in _all("RUN") if "pip install" in r]
    assert len(installs) == 2
    for run in installs:  # every install resolves against the same pins as `make venv`
        assert "-c constraints.txt" in run, run
    assert '"torch==${TORCH_VERSION}"' in installs[0]
    # the base image is pinned to the Python the constraints were resolved with
    base = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-bookworm", _args()["PYTHON_IMAGE"])
    assert base and (int(base.group(1)), int(base.group(2))) == sys.version_info[:2]
    assert _all("FROM") == ["${PYTHON_IMAGE}"]


def test_runs_as_a_non_root_user_that_owns_the_baked_weights() -> None:
    users = _all("USER")
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    assert re.search(rf"useradd .*--user-group {users[-1]}\b", _all("RUN")[0])
    last_user = max(i for i, (w, _) in enumerate(INSTR) if w == "USER")
    assert last_user < _index("CMD")
    fetch = _index("RUN", r"python -m models\.zoo fetch")
    assert last_user < fetch  # fetched as the service user, so it may convert further models at run time
    assert "python -m models.zoo verify" in INSTR[fetch][1]
    assert "load_model(DEFAULT_SPECS['generator']" in INSTR[fetch][1]  # the GGUF converted at build time
    env = " ".join(_all("ENV"))
    cache = re.search(rf"{CACHE_ENV}=(\S+)", env)
    assert cache and f"chown serve:serve {cache.group(1)}" in _all("RUN")[0]


def test_wget_is_installed_for_kuberays_default_probes_and_nginx_for_the_front() -> None:
    assert re.search(r"apt-get install -y --no-install-recommends wget\b", _all("RUN")[0])
    assert re.search(r"apt-get install -y --no-install-recommends [^&]*\bnginx\b", _all("RUN")[0])
    assert "rm -rf /var/lib/apt/lists/*" in _all("RUN")[0]


def _healthcheck_cmd() -> list[str]:
    (hc,) = _all("HEALTHCHECK")
    options, _, cmd = hc.partition(" CMD ")
    assert re.search(r"--interval=\d+s", options) and re.search(r"--start-period=\d+s", options)
    return json.loads(cmd)


class _Handler(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _server(status: int) -> Iterator[int]:
    handler = type("H", (_Handler,), {"status": status})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_passes_only_when_healthz_answers_200(status: int, healthy: bool) -> None:
    cmd = _healthcheck_cmd()
    assert cmd[:2] == ["python", "-c"] and "http://127.0.0.1:8000/healthz" in cmd[2]
    with _server(status) as port:
        script = cmd[2].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30, check=False)
    assert (done.returncode == 0) is healthy, done.stderr


def test_cmd_starts_the_service_on_the_exposed_port() -> None:
    (cmd,) = _all("CMD")
    argv = json.loads(cmd)
    assert argv[:3] == ["python", "-m", "service"]
    parsed = _parse(argv[3:])
    assert (ROOT / parsed.config).is_file() and parsed.host == "0.0.0.0"
    assert _all("EXPOSE") == [str(parsed.port)] == ["8000"]
    assert _all("WORKDIR") == ["/app"]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a folder covers its contents."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            ignored = not negate
    return ignored


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_heavy() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = [src for copy in _all("COPY") for src in copy.split()[:-1] if not src.startswith("--")]
    assert {"constraints.txt", "pyproject.toml", "README.md", "models", "service", "deploy"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not _ignored(src, patterns), f"{src} is copied but .dockerignore leaves it out"
    assert not _ignored("models/weights/sentiment-head/head.json", patterns)
    for heavy in (".venv/bin/python", ".git/HEAD", "data/sentiment", "runs/translator", "tests/conftest.py",
                  "service/testing/cluster.py",
                  "models/__pycache__/zoo.cpython-311.pyc", ".bench/results.json"):
        assert _ignored(heavy, patterns), heavy
