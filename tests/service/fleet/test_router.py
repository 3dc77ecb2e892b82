"""The prefix-aware router's policy on Serve's RequestRouter, with replicas standing in for Serve's:
a conversation sticks to the replica that holds its history while load is balanced, spreads when that
replica is overloaded, and new prompts and other calls go to the least loaded."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from service.fleet.router import (
    DECISIONS,
    PrefixAffinityRouter,
    conversation_key,
    hash_order,
    routed_request,
    routing_text,
)
from service.messages import ChatMessage, GenerationRequest

DEP = DeploymentID(name="generator", app_name="app")
SYSTEM = "You are the support assistant of Acme. Answer briefly and politely. " * 6


@dataclass
class Replica:
    """What the router reads of Serve's RunningReplica."""

    name: str
    replica_id: ReplicaID = field(init=False)
    max_ongoing_requests: int = 64
    node_id: str = "node"
    availability_zone: str | None = None
    multiplexed_model_ids: set[str] = field(default_factory=set)
    routing_stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.replica_id = ReplicaID(self.name, DEP)

    def __hash__(self) -> int:
        return hash(self.name)


class Routed:
    """A router over replicas A and B whose loads the test sets."""

    def __init__(self, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()  # Serve builds its routers on the handle's event loop
        asyncio.set_event_loop(self.loop)
        self.router = PrefixAffinityRouter(DEP, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
        self.router.initialize_state(**{"chunk_chars": 32, "min_match_chars": 64, "max_imbalance": 4, **kwargs})
        self.router._counters = {d: _Count() for d in DECISIONS}
        self.replicas = {"A": Replica("A"), "B": Replica("B")}
        self.loads = {"A": 0, "B": 0}
        self.router.load = lambda r: self.loads[r.replica_id.unique_id]  # type: ignore[method-assign]

    def route(self, *args: Any, method: str = "generate_stream") -> str:
        """The replica the request lands on: the least loaded of the first rank (as Serve picks)."""
        pending = PendingRequest(args=list(args), kwargs={}, metadata=RequestMetadata(
            request_id="r", internal_request_id=f"i{id(args)}", call_method=method))
        ranks = self.loop.run_until_complete(self.router.choose_replicas(list(self.replicas.values()), pending))
        first = min(ranks[0], key=lambda r: self.loads[r.replica_id.unique_id])
        self.router.on_request_routed(pending, first.replica_id, None)  # type: ignore[arg-type]
        return first.name

    def decisions(self) -> dict[str, int]:
        return {d: c.n for d, c in self.router._counters.items() if c.n}  # type: ignore[union-attr]


class _Count:
    n = 0

    def inc(self) -> None:
        self.n += 1


def chat(*turns: str, session: str | None = None) -> GenerationRequest:
    roles = ["user", "assistant"]
    messages = (ChatMessage("system", SYSTEM), *(ChatMessage(roles[i % 2], t) for i, t in enumerate(turns)))
    return GenerationRequest("x", messages=messages, session=session)


def test_a_conversation_sticks_to_its_replica_while_load_is_balanced() -> None:
    r = Routed()
    first = r.route(chat("Where is my order 1234?"))
    r.loads[first] += 3  # busier, within max_imbalance
    history = ["Where is my order 1234?", "It ships tomorrow."]
    for turn in range(4):
        assert r.route(chat(*history, f"And question {turn}?")) == first
        history += [f"And question {turn}?", f"Answer {turn}."]
    assert r.decisions() == {"new": 1, "prefix": 4}


def test_an_overloaded_replica_sheds_its_conversations_to_the_least_loaded() -> None:
    r = Routed()
    first = r.route(chat("Hello"))
    other = "B" if first == "A" else "A"
    r.loads[first] = 10  # more than max_imbalance (4) above the other
    assert r.route(chat("Hello", "Hi!", "Next question")) == other
    r.loads[first] = 0  # the prefix is now remembered on both: the most recent holder first
    assert r.route(chat("Hello", "Hi!", "Next question", "Sure.", "More")) == other
    assert r.decisions() == {"new": 1, "spread": 1, "prefix": 1}


def test_new_prompts_and_other_calls_go_to_the_least_loaded() -> None:
    r = Routed()
    r.loads.update(A=5, B=1)
    assert r.route(chat("Hi")) == "B"
    assert r.route(GenerationRequest("x", prompt="short"), False, method="tokenize") == "B"
    assert r.route([1, 2, 3], method="detokenize") == "B"
    assert r.decisions() == {"new": 2, "other": 1}


def test_a_short_shared_beginning_is_no_affinity() -> None:
    r = Routed(min_match_chars=10_000)  # the whole system prompt is below it
    r.route(chat("Hello"))
    r.loads["A"] = r.loads["B"] = 0
    r.route(chat("Hello", "Hi", "More"))
    assert r.decisions() == {"new": 2}


def test_sessions_stick_even_without_a_shared_prefix() -> None:
    r = Routed()
    home = r.route(GenerationRequest("x", prompt="first prompt of the session", session="s-1"))
    r.loads[home] = 3
    assert r.route(GenerationRequest("x", prompt="an unrelated second prompt", session="s-1")) == home
    r.loads[home] = 9  # overloaded: spread
    assert r.route(GenerationRequest("x", prompt="a third", session="s-1")) != home
    off = Routed(session_affinity=False)
    off.loads["A"] = 5  # past max_imbalance: whatever the prompt hashes to, B takes it
    assert off.route(GenerationRequest("x", prompt="p", session="s")) == "B"
    assert off.decisions() in ({"new": 1}, {"spread": 1})


def test_a_group_routes_by_its_first_request_and_a_gone_replica_is_forgotten() -> None:
    r = Routed()
    home = r.route([chat("Tell me a joke"), chat("Tell me a joke")], method="generate_group")
    assert r.route(chat("Tell me a joke", "Ha", "Another")) == home
    r.router.table.forget(home)  # its prefixes go: the next turn is placed by its hash again (the same replica)
    assert r.route(chat("Tell me a joke", "Ha", "Another", "Hi", "More")) == home
    assert r.decisions() == {"new": 2, "prefix": 1}


def test_routing_text_separates_roles_and_covers_tools() -> None:
    a = GenerationRequest("x", messages=(ChatMessage("user", "ab"), ChatMessage("user", "c")))
    b = GenerationRequest("x", messages=(ChatMessage("user", "a"), ChatMessage("user", "bc")))
    assert routing_text(a) != routing_text(b)
    assert routing_text(GenerationRequest("x", prompt="p")) == "p"
    assert routed_request([]) is None and routed_request([[1, 2]]) is None


@pytest.mark.parametrize("kwargs", [{}, {"session_affinity": False}])
def test_every_candidate_is_offered_so_serve_backs_off_before_asking_again(kwargs: dict[str, Any]) -> None:
    r = Routed(**kwargs)
    pending = PendingRequest(args=[chat("hi")], kwargs={}, metadata=RequestMetadata(
        request_id="r", internal_request_id="i", call_method="generate"))
    ranks = r.loop.run_until_complete(r.router.choose_replicas(list(r.replicas.values()), pending))
    assert pending.routing_context.should_backoff
    assert sorted(x.name for rank in ranks for x in rank) == ["A", "B"]


def test_new_conversations_hash_to_the_same_replica_in_every_router() -> None:
    """Two routers (two ingress replicas) that share nothing place the same new conversations on the
    same replicas, and both replicas get some."""
    placements = []
    for _ in range(2):
        r = Routed()
        placements.append([r.route(GenerationRequest("x", prompt=f"conversation {i}: a first question"))
                           for i in range(8)])
    assert placements[0] == placements[1] and set(placements[0]) == {"A", "B"}


def test_a_new_conversation_goes_elsewhere_when_its_replica_holds_more_than_its_share() -> None:
    r = Routed(max_imbalance=8)
    request = GenerationRequest("x", prompt="a conversation that hashes somewhere")
    home = r.route(request)
    other = "B" if home == "A" else "A"
    r.router.table.forget(home)
    r.loads.update({home: 3, other: 0})  # 3 of 3 requests: over 1.25 x the mean, and 2 above the least
    assert r.route(request) == other
    r.router.table.forget(other)
    r.loads.update({home: 1, other: 0})  # one above the least is always allowed
    assert r.route(request) == home
    assert r.decisions() == {"new": 2, "spread": 1}


def test_a_conversation_hashes_by_its_start_and_a_session_by_its_id() -> None:
    a, b = Replica("A"), Replica("B")
    key = conversation_key(chat("first question"), 1024)
    assert key == conversation_key(chat("first question", "answer", "second question"), 1024)
    assert key != conversation_key(chat("another first question"), 1024)
    assert conversation_key(GenerationRequest("x", prompt="p" * 5000), 1024) == "p" * 1024
    assert conversation_key(chat("q", session="s-1"), 1024) == conversation_key(chat("r", session="s-1"), 1024)
    orders = {tuple(x.name for x in hash_order(f"conversation {i}", [a, b])) for i in range(20)}
    assert orders == {("A", "B"), ("B", "A")}  # both replicas are preferred by some conversations
    assert [x.name for x in hash_order("k", [a, b])] == [x.name for x in hash_order("k", [b, a])]


def test_a_burst_decided_before_serve_sends_any_is_balanced_and_forgotten_when_routed() -> None:
    """Serve asks for many requests before its queue-length cache counts any: the requests decided
    and not yet sent count as load, so the bound on a new conversation's replica holds in a burst."""
    r = Routed()
    del r.router.load  # the router's own load (Serve's cache is empty here)
    pendings, firsts = [], []
    for i in range(12):
        meta = RequestMetadata(request_id="r", internal_request_id="shared", call_method="generate_stream")
        pending = PendingRequest(args=[GenerationRequest("x", prompt=f"burst {i}")], kwargs={}, metadata=meta)
        ranks = r.loop.run_until_complete(r.router.choose_replicas(list(r.replicas.values()), pending))
        pendings.append(pending)
        firsts.append(ranks[0][0].name if len(ranks[0]) == 1 else "any")
    assert sorted(firsts.count(n) for n in ("A", "B")) in ([6, 6], [5, 7])  # at most 1.25 x the mean
    for pending, name in zip(pendings, firsts, strict=True):
        r.router.on_request_routed(pending, r.replicas[name].replica_id, None)  # type: ignore[arg-type]
    assert r.router.load(r.replicas["A"]) == r.router.load(r.replicas["B"]) == 0


def test_an_adapters_requests_go_to_the_replicas_its_name_hashes_to_and_prefixes_stay_per_adapter() -> None:
    """New conversations of one adapter land where its name hashes (the replica that then holds it),
    whatever their text; the same text under two adapters is two prefixes."""
    from service.messages import AdapterRef

    def asking(adapter: str, i: int) -> GenerationRequest:
        return GenerationRequest("x", prompt=f"conversation {i}: a first question", adapter=AdapterRef(adapter, "/a"))

    r = Routed()
    for name in ("support", "summaries"):
        home = {r.route(asking(name, i)) for i in range(6)}
        assert len(home) == 1
    plain = GenerationRequest("x", prompt="shared text")
    adapted = GenerationRequest("x", prompt="shared text", adapter=AdapterRef("support", "/a"))
    assert routing_text(plain) != routing_text(adapted) and routing_text(adapted).endswith("shared text")
    assert conversation_key(adapted, 1024) != conversation_key(plain, 1024)


def test_an_adapters_requests_go_to_the_replicas_that_hold_it_while_they_are_not_overloaded() -> None:
    """Serve's model multiplexing: a replica reports the adapters it holds (multiplexed_model_ids); an
    adapter's requests go there before its name's hash order, and spread when it is overloaded."""
    from service.messages import AdapterRef

    def asking(i: int) -> GenerationRequest:
        return GenerationRequest("x", prompt=f"conversation {i}: a first question", adapter=AdapterRef("support", "/a"))

    r = Routed()
    hashed = r.route(asking(0))
    other = "B" if hashed == "A" else "A"
    r.replicas[other].multiplexed_model_ids = {"support"}  # it holds the adapter now; the hashed one does not
    assert {r.route(asking(i)) for i in range(1, 6)} == {other}
    assert r.decisions()["adapter"] == 5
    r.loads[other] = 10  # past max_imbalance: the least loaded takes it
    assert r.route(asking(7)) == hashed and r.decisions()["spread"] == 1
    r.loads[other] = 0
    r.route(GenerationRequest("x", prompt="conversation 9: a first question"))  # the bare model: hashed
    assert r.decisions()["adapter"] == 5 and r.decisions()["new"] == 2
