"""`python -m loadtests.tenants` against a stand-in streaming server on 127.0.0.1: each tenant's
requests carry its key or its `priority` field (and the peer's model name), the row comes out; the
flood itself runs against the real engines by hand (docs/reliability.md)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from loadtests import tenants


@pytest.fixture()
def server() -> Iterator[tuple[str, list[tuple[str, dict, str | None]]]]:
    """A server that streams two content chunks per completion and records (route, body, auth)."""
    seen: list[tuple[str, dict, str | None]] = []
    app = FastAPI()

    async def stream(request: Request, route: str) -> StreamingResponse:
        body = await request.json()
        seen.append((route, body, request.headers.get("authorization")))
        delta = {"delta": {"content": "x"}} if route == "chat" else {"text": "x"}

        async def chunks():
            for _ in range(2):
                yield f"data: {json.dumps({'choices': [delta]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        return await stream(request, "chat")

    @app.post("/v1/completions")
    async def completion(request: Request) -> StreamingResponse:
        return await stream(request, "completion")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", seen
    srv.should_exit = True
    thread.join(5)


def test_each_tenant_is_told_apart_by_its_priority_field_and_the_row_comes_out(server, capsys) -> None:
    url, seen = server
    assert tenants.main(["--url", url, "--calm-priority", "0", "--flood-priority", "10", "--model", "smollm2",
                         "--flood", "2", "--requests", "3", "--ramp-s", "0.2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["alone_p50_s"] > 0 and row["flood_p95_s"] > 0 and set(row["flood_statuses"]) == {"200"}
    chats = [body for route, body, _ in seen if route == "chat"]
    floods = [body for route, body, _ in seen if route == "completion"]
    assert len(chats) == 2 + 3 + 3 and floods  # warm-up, alone, under the flood
    assert all(b["priority"] == 0 and b["model"] == "smollm2" and b["stream"] for b in chats)
    assert all(b["priority"] == 10 and b["model"] == "smollm2" for b in floods)
    assert all(auth is None for *_, auth in seen)


def test_keys_go_in_the_authorization_header_without_a_priority_field(server, capsys) -> None:
    url, seen = server
    assert tenants.main(["--url", url, "--calm-key", "k1", "--flood-key", "k2", "--flood", "1", "--requests", "2",
                         "--ramp-s", "0.1", "--json"]) == 0
    assert {auth for route, _, auth in seen if route == "chat"} == {"Bearer k1"}
    assert {auth for route, _, auth in seen if route == "completion"} == {"Bearer k2"}
    assert not any("priority" in body or "model" in body for _, body, _ in seen)


@pytest.mark.parametrize("argv", [["--url", "http://10.0.0.1:8000", "--calm-key", "a", "--flood-key", "b"],
                                  ["--calm-key", "a"], ["--calm-priority", "0", "--flood-key", "b", "--calm-key", "a",
                                                        "--url", "http://example.com"]])
def test_it_refuses_another_machine_and_a_tenant_it_cannot_tell_apart(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        tenants.main(argv)
