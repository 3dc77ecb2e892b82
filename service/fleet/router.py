"""Prefix-aware routing of generation requests over a deployment's replicas, on Serve's RequestRouter API.

Serve builds one router per deployment handle, in the process that holds the handle (each ingress
replica), and asks it for each request which replicas to try: ranks of replicas, best first; Serve
sends the request to the least loaded replica of the first rank that has a free slot
(max_ongoing_requests). Here, for a generation (a GenerationRequest, or a group of them, as the
first argument):

- **session**: a request with a session id (`x-session-id`, the OpenAI `user`) goes where the
  session's last request went;
- **prefix**: else the replicas this router sent the longest prefix of its prompt text to
  (PrefixTable, at least `min_match_chars`) are tried first: a conversation's next turn finds its
  history in that replica's prefix cache;
- **adapter**: else a LoRA adapter's request goes to the replicas that hold the adapter (Serve's model
  multiplexing: each replica reports the adapters it holds, service/replica/adapters.py, and the
  request carries its adapter as the multiplexed model id, service/ingress.py), least loaded first;
- **new**: a prompt this router has not seen goes to the replica its conversation hashes to
  (rendezvous hashing of the conversation's start: the chat up to its first user message, or the
  prompt's first `key_chars` characters; a session by its id; a LoRA adapter's first requests by the
  adapter's name, so that they land together), so that every ingress replica sends a
  conversation to the same replica without sharing any state, and a replica added or removed moves
  only the conversations that hash to it;
- a new conversation also only while its replica would hold at most 1.25x the mean load (consistent
  hashing with bounded loads, Mirrokni et al. 2018), and each only while that replica has at most
  `max_imbalance` more ongoing requests than the least loaded one (counted by this router: requests it sent that have not completed, or Serve's cache if
  larger); past it the request is **spread**: the least loaded replica takes it (a new conversation:
  the next replica of its hash order within the bound), and its prefix is then remembered there;
- other methods (**other**: info, tokenize) go to the least loaded.

Why not Ray's PrefixCacheAffinityRouter (ray.serve.llm): it blocks the router's event loop on a
remote prefix-tree actor several times per request, reads `prompt`/`messages` only as OpenAI dicts
(ours are dataclasses: it would match nothing), fails on any other method's arguments, and imports
ray.llm's dependencies (pyarrow) into the ingress.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from ..common.tool_calls import Tool
from ..messages import ChatMessage, GenerationRequest
from .prefix_table import Chain, PrefixTable

MAX_DECIDED = 100_000  # decisions kept for requests not yet routed
HASH_LOAD_FACTOR = 1.25  # a new conversation's hashed replica may hold up to this x the mean load
# what a routing decision was, the label of transformer_serve_routing_decisions_total
DECISIONS = ("session", "prefix", "adapter", "spread", "new", "other")


def routed_request(args: Sequence[Any]) -> GenerationRequest | None:
    """The generation a call's arguments carry (a group's first: siblings share the prompt)."""
    first = args[0] if args else None
    if isinstance(first, list | tuple) and first:
        first = first[0]
    return first if isinstance(first, GenerationRequest) else None


def conversation_key(request: GenerationRequest, key_chars: int) -> str:
    """What identifies a request's conversation for hashing: its session; else its LoRA adapter (every
    conversation of an adapter hashes to the same replicas, which then hold it: no load per replica);
    else the chat up to and including its first user message (every later turn starts with it); else
    the prompt's first `key_chars` characters."""
    if request.session:
        return "session\x1f" + request.session
    if request.adapter is not None:
        return "adapter\x1f" + request.adapter.name
    if request.messages is None:
        return (request.prompt or "")[:key_chars]
    first_user = next((i for i, m in enumerate(request.messages) if m.role == "user"), len(request.messages) - 1)
    return chat_text(request.messages[:first_user + 1], request.tools)


def hash_order(key: str, replicas: list[RunningReplica]) -> list[RunningReplica]:
    """`replicas` by rendezvous hashing of `key`: the same order in every process for the same key and
    replicas; removing a replica leaves the others' order as it was."""
    digest = hashlib.blake2b(key.encode(errors="surrogatepass"), digest_size=16).digest()

    def score(replica: RunningReplica) -> bytes:
        return hashlib.blake2b(replica.replica_id.unique_id.encode(), key=digest, digest_size=8).digest()

    return sorted(replicas, key=score, reverse=True)


def routing_text(request: GenerationRequest) -> str:
    """The text whose prefix decides the replica: the prompt, or the chat (chat_text), after its
    adapter's name (a prefix cached for one adapter is no use to another)."""
    adapter = "" if request.adapter is None else f"\x1c{request.adapter.name}\x1c"
    if request.messages is None:
        return adapter + (request.prompt or "")
    return adapter + chat_text(request.messages, request.tools)


def chat_text(messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> str:
    """A chat as the template renders it in order (tools first, then each message's role and content),
    separators included so that different splits of the same characters differ."""
    parts = [f"\x1d{t.name}\x1f{t.description}\x1f{t.parameters}" for t in tools]
    for m in messages:
        calls = "".join(f"\x1f{c.name}\x1f{c.arguments}" for c in m.tool_calls)
        parts.append(f"\x1e{m.role}\x1f{m.content}{calls}")
    return "".join(parts)


class PrefixAffinityRouter(RequestRouter):
    """See the module docstring. Runs on the handle's event loop; choose_replicas never waits."""

    def initialize_state(self, chunk_chars: int = 128, min_match_chars: int = 256, max_imbalance: int = 8,
                         session_affinity: bool = True, max_chunks: int = 200_000, key_chars: int = 1024,
                         deployment: str = "") -> None:
        self.table = PrefixTable(chunk_chars, max_chunks)
        self.min_match_chars, self.max_imbalance, self.key_chars = min_match_chars, max_imbalance, key_chars
        self.session_affinity = session_affinity
        self.deployment = deployment
        # id(pending request) -> (decision, first rank, its text's chain), until Serve routes it (the
        # internal request id is shared by the calls of one HTTP request)
        self._decided: dict[int, tuple[str, frozenset[str], Chain]] = {}
        # replica -> requests decided for it and not yet sent: a burst of requests is decided before
        # Serve's queue-length cache counts any of them
        self._deciding: Counter[str] = Counter()
        self._counters: dict[str, Any] | None = None

    # -- Serve's hooks -------------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:  # every candidate is offered: Serve backs off before asking again
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        request = routed_request(pending_request.args) if pending_request is not None else None
        chain = self.table.chain(routing_text(request)) if request is not None else ()
        decision, first = self.decide(request, candidate_replicas, chain)
        if pending_request is not None:
            self._forget_decision(id(pending_request))  # asked again (Serve backed off): the last answer goes
            if len(self._decided) > MAX_DECIDED:  # requests cancelled before they were routed
                self._decided.clear()
                self._deciding.clear()
            ids = frozenset(r.replica_id.unique_id for r in first)
            self._decided[id(pending_request)] = (decision, ids, chain)
            if len(first) == 1:  # counted as load there until Serve sends it (and counts it itself)
                self._deciding[first[0].replica_id.unique_id] += 1
        if not first:
            return [shuffled(candidate_replicas)]  # one rank: Serve takes its least loaded replica
        rest = [r for r in candidate_replicas if r not in first]
        return [first, rest] if rest else [first]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        decision, first, chain = self._forget_decision(id(pending_request))
        replica = replica_id.unique_id
        if first and replica not in first:  # the preferred replicas were full: Serve took another
            decision = "spread"
        self._count(decision)
        request = routed_request(pending_request.args)
        if request is None:
            return
        self.table.record(chain, replica)
        if self.session_affinity and request.session:
            self.table.bind_session(request.session, replica)

    def _forget_decision(self, key: int) -> tuple[str, frozenset[str], Chain]:
        decision, first, chain = self._decided.pop(key, ("other", frozenset(), ()))
        if len(first) == 1:
            (replica,) = first
            self._deciding[replica] -= 1
            if self._deciding[replica] <= 0:
                del self._deciding[replica]
        return decision, first, chain

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        for gone in before - {r.unique_id for r in self.curr_replicas}:
            self.table.forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)

    # -- the policy ----------------------------------------------------------------------------------

    def decide(self, request: GenerationRequest | None, candidates: list[RunningReplica], chain: Chain
               ) -> tuple[str, list[RunningReplica]]:
        """(decision, the replicas to try first; [] = all, least loaded first); `chain`: the request's
        routing text in the table's chunks."""
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
        match = self.table.match(chain, by_id.keys())
        if match.chars >= self.min_match_chars and match.replicas:
            held = [by_id[r] for r in match.replicas if balanced(r)]
            return ("prefix", held) if held else ("spread", [])
        if request.adapter is not None:
            holding = [r for r in candidates if request.adapter.name in r.multiplexed_model_ids]
            if holding:
                fit = [r for r in holding if balanced(r.replica_id.unique_id)]
                return ("adapter", fit) if fit else ("spread", [])
        if not self.session_affinity:
            request = dataclasses.replace(request, session=None)
        order = hash_order(conversation_key(request, self.key_chars), candidates)
        # consistent hashing with bounded loads: a replica takes a new conversation while it would hold
        # at most HASH_LOAD_FACTOR x the mean load, so that hashing never piles conversations up
        # (one request above the least loaded is always allowed: at a handful of requests the mean says little)
        cap = math.ceil(HASH_LOAD_FACTOR * (sum(loads.values()) + 1) / len(candidates))
        within = [r for r in order if balanced(r.replica_id.unique_id)
                  and (loads[r.replica_id.unique_id] < cap or loads[r.replica_id.unique_id] <= least + 1)]
        decision = "session" if request.session else "new"
        return (decision, within[:1]) if within[:1] == order[:1] else ("spread", within[:1])

    def load(self, replica: RunningReplica) -> int:
        """Ongoing requests at `replica`: Serve's queue-length cache (what the replica reported at its
        last probe, plus what this router sent since; unknown: 0), plus the requests decided for it and
        not yet sent. Not a count of completions of our own: Serve calls on_request_completed before
        on_request_routed for quick calls, and the calls of one HTTP request share their request id."""
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        return (int(queued) if queued is not None else 0) + self._deciding.get(replica.replica_id.unique_id, 0)

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
