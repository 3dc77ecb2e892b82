"""Which replica saw which prompt prefix: the prefix-aware router's memory (router.py), no Ray.

A prompt's text is cut into chunks of `chunk_chars` characters; chunk i is keyed by a chain hash of
chunks 0..i, so a key stands for a whole prefix, as the engine's prefix cache keys its token blocks
(service/engine/prefix_cache.py). Each key remembers the replicas that were sent a prompt with that
prefix, most recent first. A match walks a prompt's chain while some candidate replica has the
prefix: the replicas with the longest one, and its length in characters. Sessions (a client's
`x-session-id` or OpenAI `user`) remember the replica their last request went to. Both are bounded,
least recently used forgotten first. Not thread-safe: a router's event loop only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass

OWNERS_PER_PREFIX = 4  # replicas remembered per prefix (a popular system prompt spreads over several)


Chain = tuple[tuple[int, int], ...]  # a text's whole chunks: (chain key, characters covered), first to last


@dataclass(frozen=True)
class Match:
    """The candidates holding the longest prefix of a prompt (most recent first), and its length."""

    replicas: tuple[str, ...]
    chars: int


def chunk_keys(text: str, chunk_chars: int) -> Iterator[tuple[int, int]]:
    """(chain key, characters covered) of each whole chunk of `text`, first to last."""
    key = 0
    for end in range(chunk_chars, len(text) + 1, chunk_chars):
        key = hash((key, text[end - chunk_chars:end]))
        yield key, end


def session_key(session: str) -> str:
    """What the table keeps of a session id: a digest (the id itself is the client's, never stored)."""
    return hashlib.blake2b(session.encode(), digest_size=16).hexdigest()


class PrefixTable:
    def __init__(self, chunk_chars: int = 128, max_chunks: int = 200_000, max_sessions: int = 100_000) -> None:
        self.chunk_chars, self.max_chunks, self.max_sessions = chunk_chars, max_chunks, max_sessions
        self._owners: OrderedDict[int, tuple[str, ...]] = OrderedDict()  # chain key -> replicas, recent first
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session digest -> replica

    def __len__(self) -> int:
        return len(self._owners)

    def chain(self, text: str) -> Chain:
        """`text`'s whole chunks as (chain key, characters covered): what match and record take, so a
        request's text is hashed once."""
        return tuple(chunk_keys(text, self.chunk_chars))

    def match(self, chain: Chain, candidates: Collection[str]) -> Match:
        """The candidates that were sent the longest prefix of a text (its `chain`)."""
        best = Match((), 0)
        for key, chars in chain:
            owners = self._owners.get(key)
            held = tuple(r for r in owners if r in candidates) if owners else ()
            if not held:
                break
            self._owners.move_to_end(key)
            best = Match(held, chars)
        return best

    def record(self, chain: Chain, replica: str) -> None:
        """`replica` was sent a text (its `chain`): it holds (or soon will) each of its prefixes."""
        for key, _ in chain:
            owners = self._owners.pop(key, ())
            self._owners[key] = (replica, *(r for r in owners if r != replica))[:OWNERS_PER_PREFIX]
        while len(self._owners) > self.max_chunks:
            self._owners.popitem(last=False)

    def session(self, session: str) -> str | None:
        """The replica the session's last request went to."""
        key = session_key(session)
        replica = self._sessions.get(key)
        if replica is not None:
            self._sessions.move_to_end(key)
        return replica

    def bind_session(self, session: str, replica: str) -> None:
        key = session_key(session)
        self._sessions.pop(key, None)
        self._sessions[key] = replica
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica left the fleet: its prefixes and sessions go (the others' stay)."""
        for key in list(self._owners):
            owners = tuple(r for r in self._owners[key] if r != replica)
            if owners:
                self._owners[key] = owners
            else:
                del self._owners[key]
        for key in [k for k, r in self._sessions.items() if r == replica]:
            del self._sessions[key]
