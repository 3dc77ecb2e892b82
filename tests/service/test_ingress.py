"""The ingress's ServeBackend without Ray Serve running: /readyz's readiness from the controller's
replica counts and what the ingress has seen, probing a replica only when it has not seen one."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import pytest

from service import ingress
from service.messages import ModelInfo


class FakeResponse:
    def __init__(self, handle: FakeHandle) -> None:
        self.handle = handle

    def __await__(self) -> Generator[Any, None, ModelInfo]:
        yield from asyncio.sleep(0).__await__()
        if self.handle.dead:
            raise ingress.RayActorError()
        return ModelInfo("m", "enc", ("classify",), "cpu", "float32", 8)

    def cancel(self) -> None:
        pass


class FakeHandle:
    """A DeploymentHandle's info.remote(), counted; `dead` fails it as a killed replica does."""

    def __init__(self) -> None:
        self.info_calls, self.dead = 0, False

    def options(self, **_: Any) -> FakeHandle:
        return self

    @property
    def info(self) -> FakeHandle:
        return self

    def remote(self) -> FakeResponse:
        self.info_calls += 1
        return FakeResponse(self)


def test_readiness_probes_a_replica_only_until_it_has_seen_one(monkeypatch: pytest.MonkeyPatch) -> None:
    running = {"enc": 1}
    lookups = []

    def replicas() -> dict[str, dict[str, int]]:
        lookups.append(1)
        return {name: {"RUNNING": n, "STOPPING": 1} for name, n in running.items()}

    monkeypatch.setattr(ingress, "_replica_states", replicas)
    handle = FakeHandle()
    backend = ingress.ServeBackend({"enc": handle}, readiness_timeout_s=1.0)

    async def main() -> list[dict[str, str]]:
        out = [await backend.readiness(["enc"], 1.0)]  # not seen yet: one info() call
        out += await asyncio.gather(*(backend.readiness(["enc"], 1.0) for _ in range(5)))  # cached
        assert handle.info_calls == 1 and len(lookups) == 1
        monkeypatch.setattr(ingress, "READINESS_CACHE_S", 0.0)
        for _ in range(3):  # seen: no replica call, however often it is asked
            out.append(await backend.readiness(["enc"], 1.0))
        assert handle.info_calls == 1 and len(lookups) == 4
        running["enc"] = 0  # the controller lost the replica
        out.append(await backend.readiness(["enc"], 1.0))
        running["enc"] = 1
        backend._failed("enc", ingress.RayActorError())  # a request found it dead: probe again
        handle.dead = True
        out.append(await backend.readiness(["enc"], 1.0))
        handle.dead = False
        monkeypatch.setattr(ingress, "_replica_states", lambda: 1 / 0)  # no controller: ask the replica
        out.append(await backend.readiness(["enc"], 1.0))
        return out

    states = [s["enc"] for s in asyncio.run(main())]
    assert states[:9] == ["ready"] * 9
    assert states[9] == "enc: no running replica"
    assert states[10] != "ready" and "died" in states[10]
    assert states[11] == "ready"


def test_calls_to_an_unseen_deployment_share_one_readiness_probe() -> None:
    """A burst of calls before the ingress has seen the deployment answer (start-up, after an outage):
    one info() probe for all of them, then each call; a failed probe fails every waiting call."""
    handle = FakeHandle()
    backend = ingress.ServeBackend({"enc": handle}, readiness_timeout_s=1.0)

    async def burst(n: int) -> list[Any]:
        return await asyncio.gather(*(backend.call("enc", "info") for _ in range(n)), return_exceptions=True)

    handle.dead = True  # the replica is gone: every call gets the one probe's NotReady
    failed = asyncio.run(burst(20))
    assert handle.info_calls == 1 and all(isinstance(e, ingress.NotReady) for e in failed), failed
    handle.dead, handle.info_calls = False, 0
    answered = asyncio.run(burst(20))
    assert handle.info_calls == 1 + 20  # one probe, then the calls themselves (before: 20 probes)
    assert all(isinstance(a, ModelInfo) for a in answered)
    asyncio.run(burst(5))
    assert handle.info_calls == 21 + 5  # seen: no probe


def test_a_probe_whose_callers_all_went_away_ends_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """Callers cancelled (deadline, hang-up) while the shared probe runs: it still ends, its NotReady
    is retrieved (no "exception was never retrieved" from asyncio), and the next call probes again."""
    import gc

    handle = FakeHandle()
    handle.dead = True
    backend = ingress.ServeBackend({"enc": handle}, readiness_timeout_s=1.0)

    async def main() -> None:
        calls = [asyncio.ensure_future(backend.call("enc", "info")) for _ in range(3)]
        await asyncio.sleep(0)
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.sleep(0.01)  # the probe ends without its callers
        assert backend._probes == {} and handle.info_calls == 1
        handle.dead = False
        assert isinstance(await backend.call("enc", "info"), ModelInfo)  # probed again, then called
        assert handle.info_calls == 3

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert "never retrieved" not in caplog.text
