"""Prefix-aware routing of generation requests over a deployment's replicas, on Serve's RequestRouter API.

Serve builds one router per deployment handle, in the process that holds the handle (the ingress),
and asks it for each request which replicas to try: ranks of replicas, best first; Serve sends the
request to the least loaded replica of the first rank that has a free slot (max_ongoing_requests).
Here, for a generation (a GenerationRequest, or a group of them, as the first argument):

- **session**: a request with a session id (`x-session-id`, the OpenAI `user`) goes where the
  session's last request went;
- **prefix**: else the replicas that were sent the longest prefix of its prompt text (PrefixTable,
  at least `min_match_chars`) are tried first: a conversation's next turn finds its history in that
  replica's prefix cache;
- either only while that replica has at most `max_imbalance` more ongoing requests than the least
  loaded one (this router's count: requests it sent and that have not ended); past it the request is
  **spread**: the least loaded replica takes it, and its prefix is then remembered there too;
- **new** prompts (no match) and other methods (**other**: info, tokenize) go to the least loaded.

Why not Ray's PrefixCacheAffinityRouter (ray.serve.llm): it blocks the router's event loop on a
remote prefix-tree actor several times per request, reads `prompt`/`messages` only as OpenAI dicts
(ours are dataclasses: it would match nothing), fails on any other method's arguments, and imports
ray.llm's dependencies (pyarrow) into the ingress. This one keeps its table in the router's process:
several ingress replicas each learn the same conversations' placement from what they route.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from ..messages import GenerationRequest
from .prefix_table import PrefixTable

# what a routing decision was, the label of transformer_serve_routing_decisions_total
DECISIONS = ("session", "prefix", "spread", "new", "other")


def routed_request(args: Sequence[Any]) -> GenerationRequest | None:
    """The generation a call's arguments carry (a group's first: siblings share the prompt)."""
    first = args[0] if args else None
    if isinstance(first, list | tuple) and first:
        first = first[0]
    return first if isinstance(first, GenerationRequest) else None


def routing_text(request: GenerationRequest) -> str:
    """The text whose prefix decides the replica: the prompt, or the chat as the template renders it
    in order (tools first, then each message's role and content), separators included so that
    different splits of the same characters differ."""
    if request.messages is None:
        return request.prompt or ""
    parts = [f"\x1d{t.name}\x1f{t.description}\x1f{t.parameters}" for t in request.tools]
    for m in request.messages:
        calls = "".join(f"\x1f{c.name}\x1f{c.arguments}" for c in m.tool_calls)
        parts.append(f"\x1e{m.role}\x1f{m.content}{calls}")
    return "".join(parts)


class PrefixAffinityRouter(RequestRouter):
    """See the module docstring. Runs on the handle's event loop; choose_replicas never waits."""

    def initialize_state(self, chunk_chars: int = 128, min_match_chars: int = 256, max_imbalance: int = 8,
                         session_affinity: bool = True, max_chunks: int = 200_000, deployment: str = "") -> None:
        self.table = PrefixTable(chunk_chars, max_chunks)
        self.min_match_chars, self.max_imbalance = min_match_chars, max_imbalance
        self.session_affinity = session_affinity
        self.deployment = deployment
        self._decided: dict[str, tuple[str, frozenset[str]]] = {}  # request id -> (decision, first rank)
        self._sent: dict[str, str] = {}  # request id -> replica, until the request completes
        self._inflight: Counter[str] = Counter()  # replica -> requests this router sent that have not completed
        self._counters: dict[str, Any] | None = None

    # -- Serve's hooks -------------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:  # every candidate is offered: Serve backs off before asking again
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        request = routed_request(pending_request.args) if pending_request is not None else None
        decision, first = self.decide(request, candidate_replicas)
        if pending_request is not None:
            self._decided[pending_request.metadata.internal_request_id] = (
                decision, frozenset(r.replica_id.unique_id for r in first))
        if not first:
            return [shuffled(candidate_replicas)]  # one rank: Serve takes its least loaded replica
        rest = [r for r in candidate_replicas if r not in first]
        return [first, rest] if rest else [first]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        request_id = pending_request.metadata.internal_request_id
        decision, first = self._decided.pop(request_id, ("other", frozenset()))
        replica = replica_id.unique_id
        self._sent[request_id] = replica
        self._inflight[replica] += 1
        if first and replica not in first:  # the preferred replicas were full: Serve took another
            decision = "spread"
        self._count(decision)
        request = routed_request(pending_request.args)
        if request is None:
            return
        self.table.record(routing_text(request), replica)
        if self.session_affinity and request.session:
            self.table.bind_session(request.session, replica)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self._sent.pop(internal_request_id, None)
        if replica is not None:
            self._inflight[replica] -= 1
            if self._inflight[replica] <= 0:
                del self._inflight[replica]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        for gone in before - {r.unique_id for r in self.curr_replicas}:
            self.table.forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)

    # -- the policy ----------------------------------------------------------------------------------

    def decide(self, request: GenerationRequest | None, candidates: list[RunningReplica]
               ) -> tuple[str, list[RunningReplica]]:
        """(decision, the replicas to try first; [] = all, least loaded first)."""
        if request is None:
            return "other", []
        loads = {r.replica_id.unique_id: self.load(r) for r in candidates}
        least = min(loads.values())
        by_id = {r.replica_id.unique_id: r for r in candidates}

        def balanced(replica: str) -> bool:
            return loads[replica] - least <= self.max_imbalance

        if self.session_affinity and request.session:
            replica = self.table.session(request.session)
            if replica in by_id:
                return ("session", [by_id[replica]]) if balanced(replica) else ("spread", [])
        match = self.table.match(routing_text(request), by_id.keys())
        if match.chars < self.min_match_chars or not match.replicas:
            return "new", []
        held = [by_id[r] for r in match.replicas if balanced(r)]
        return ("prefix", held) if held else ("spread", [])

    def load(self, replica: RunningReplica) -> int:
        """Ongoing requests at `replica`: the larger of what this router sent there and has not seen
        complete, and Serve's queue-length cache (every router's requests, as last probed; it forgets
        stale entries, so a burst of new conversations would otherwise see equal loads)."""
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        return max(self._inflight.get(replica.replica_id.unique_id, 0), int(queued) if queued is not None else 0)

    def _count(self, decision: str) -> None:
        if self._counters is None:  # built on first use: Serve may build the router before the ingress binds metrics
            self._counters = decision_counters(self.deployment)
        self._counters[decision].inc()


def decision_counters(deployment: str) -> dict[str, Any]:
    """This process's routing_decisions_total{deployment, decision} for every decision (exported at 0)."""
    from ..telemetry.metrics import process_metrics

    family = process_metrics()["routing_decisions_total"]
    return {d: family.labels(deployment, d) for d in DECISIONS}


def shuffled(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """A random order (ties between equally loaded replicas)."""
    return random.sample(replicas, len(replicas))
