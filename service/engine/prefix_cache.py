"""Automatic prefix caching: the keys/values of blocks already computed (prompts, and finished requests'
answers: engine/blocks.py `keep_outputs`), kept by content, so a request with the same beginning (a
system prompt, a chat history, n > 1 siblings) prefills only the rest.

A full block of BLOCK tokens is keyed by a chain hash (128-bit BLAKE2b of its parent's key and its
tokens: no client can craft a collision), so it is reused only after the same whole prefix, and within
one `salt` (the first block's parent: a request's adapter, whose keys differ from the base model's for
the same tokens, and its tenant's or its own cache salt); entries keep their tokens and parent,
compared on lookup, so even a collision would never serve another prompt's keys. A hit is at most len(prompt) - 1 tokens (the last
is always computed for its logits). `PrefixCache` copies into and out of a dense cache's rows;
`PagedPrefixCache` holds references on a paged cache's blocks and hands them to the new row, and
`reclaim` gives back blocks no row uses, least recently used first. An admission `pin`s its hit until
its prefill: neither eviction nor `reclaim` takes a pinned entry. Engine thread only (no locks).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from models.cache.dense import KVCache
from models.cache.paged import BLOCK_TOKENS, PagedKVCache

BLOCK = BLOCK_TOKENS  # tokens per cached block: a paged cache's block


def chain_key(parent: int | None, data: bytes) -> int:
    """A block's key: BLAKE2b (128 bits) of its parent's key (none: a root) and its bytes (a salt's and
    a block's tokens' prefixed apart, so that no salt is ever the key of a block)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    h.update(data)
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class Pin:
    """Entries an admission keeps until its prefill (`PrefixCache.pin`)."""

    keys: tuple[int, ...]  # chain hashes pinned
    taken: int  # pool blocks that were reclaimable before this pin and no longer are


@dataclass(frozen=True)
class _Entry:
    parent: int | None  # the chain hash of the block before (None: the first block)
    tokens: tuple[int, ...]  # this block's BLOCK tokens
    kv: Tensor  # (2 * layers, K, BLOCK, D): keys then values of every layer


class PrefixCache:
    """Full blocks' keys/values, content-addressed, LRU within `budget_bytes`."""

    def __init__(self, cache: KVCache, budget_bytes: int) -> None:
        self.cache = cache
        self.block_bytes = self._block_bytes()
        self.capacity = budget_bytes // self.block_bytes  # blocks
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # chain hash -> entry, least recent first
        self._pins: Counter[int] = Counter()  # chain hash -> admissions counting on it (never evicted)

    def _block_bytes(self) -> int:
        k = self.cache.k[0]
        return 2 * len(self.cache.k) * k.size(1) * BLOCK * k.size(3) * k.element_size()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return len(self._entries) * self.block_bytes

    @staticmethod
    def _chain(prompt: Sequence[int], blocks: int, salt: str = "") -> list[tuple[int, int | None, tuple[int, ...]]]:
        """(chain hash, parent's chain hash, tokens) of the prompt's first `blocks` full blocks under `salt`."""
        chain, parent = [], (chain_key(None, b"salt:" + salt.encode()) if salt else None)
        for i in range(blocks):
            tokens = tuple(prompt[i * BLOCK:(i + 1) * BLOCK])
            key = chain_key(parent, b"tokens:" + array("q", tokens).tobytes())
            chain.append((key, parent, tokens))
            parent = key
        return chain

    def lookup(self, prompt: Sequence[int], salt: str = "") -> int:
        """Tokens of `prompt` whose keys/values are cached (a multiple of BLOCK, < len(prompt))."""
        if self.capacity == 0:
            return 0
        hit = 0
        for key, parent, tokens in self._chain(prompt, (len(prompt) - 1) // BLOCK, salt):
            entry = self._entries.get(key)
            if entry is None or entry.parent != parent or entry.tokens != tokens:
                break
            hit += BLOCK
        return hit

    def load(self, prompt: Sequence[int], tokens: int, row: int, salt: str = "") -> None:
        """Copy the cached keys/values of the prompt's first `tokens` (a lookup() result) into slots
        [0, tokens) of cache row `row`; the caller sets the row's length."""
        if tokens == 0:
            return
        chain = self._chain(prompt, tokens // BLOCK, salt)
        self._touch(chain)
        kv = torch.stack([self._entries[key].kv for key, _, _ in chain], dim=2)  # (2 * layers, K, n, BLOCK, D)
        kv = kv.flatten(2, 3)  # (2 * layers, K, tokens, D)
        n_layers = len(self.cache.k)
        for i in range(n_layers):
            self.cache.k[i][row, :, :tokens] = kv[i]  # (K, tokens, D)
            self.cache.v[i][row, :, :tokens] = kv[n_layers + i]  # (K, tokens, D)

    def store(self, prompt: Sequence[int], row: int, salt: str = "") -> int:
        """Keep the full blocks of `prompt`, whose keys/values are in slots [0, len) of cache row
        `row`, that are not cached yet; evict least recently used blocks past the budget. Returns
        the blocks added."""
        if self.capacity == 0:
            return 0
        chain = self._chain(prompt, min(len(prompt) // BLOCK, self.capacity), salt)
        new = [(i, key, parent, tokens) for i, (key, parent, tokens) in enumerate(chain)
               if key not in self._entries]
        if not new:
            self._touch(chain)
            return 0
        first, end = new[0][0] * BLOCK, (new[-1][0] + 1) * BLOCK  # the span of the new blocks only
        kv = torch.stack([buf[row, :, first:end] for buf in self.cache.k + self.cache.v])  # (2 * layers, K, n, D)
        kv = kv.unflatten(2, ((end - first) // BLOCK, BLOCK))  # (2 * layers, K, blocks, BLOCK, D)
        for i, key, parent, tokens in new:
            self._entries[key] = _Entry(parent, tokens, kv[:, :, i - new[0][0]].clone())  # (2 * layers, K, BLOCK, D)
        self._touch(chain)
        self._evict_past_capacity()
        return len(new)

    def _evict_past_capacity(self) -> None:
        """Least recently used entries out while past the budget; pinned ones stay (the budget may be
        exceeded until they are unpinned)."""
        excess = len(self._entries) - self.capacity
        if excess > 0:
            for key in [k for k in self._entries if k not in self._pins][:excess]:
                self._drop(key)

    def _drop(self, key: int) -> None:
        del self._entries[key]

    def pin(self, prompt: Sequence[int], tokens: int, salt: str = "") -> Pin:
        """Keep the entries of the prompt's first `tokens` (a lookup() result) until unpin()."""
        keys = tuple(key for key, _, _ in self._chain(prompt, tokens // BLOCK, salt))
        taken = sum(1 for key in keys if self._reclaimable(key))
        self._pins.update(keys)
        return Pin(keys, taken)

    def unpin(self, pin: Pin) -> None:
        self._pins.subtract(pin.keys)
        for key in pin.keys:
            if self._pins[key] <= 0:
                del self._pins[key]
        self._evict_past_capacity()

    def _reclaimable(self, key: int) -> bool:
        """Whether the pool could have this entry's block back (copies hold none)."""
        return False

    def _touch(self, chain: list[tuple[int, int | None, tuple[int, ...]]]) -> None:
        """Mark a chain's blocks recently used, the first block most recently: eviction then takes a
        prefix's last blocks before its first ones, never leaving unreachable blocks behind."""
        for key, _, _ in reversed(chain):
            if key in self._entries:
                self._entries.move_to_end(key)

    def clear(self) -> None:
        self._entries.clear()

    def reclaimable(self) -> int:
        """Blocks only this cache holds (a paged pool could have them back); 0 for copies."""
        return 0

    def reclaim(self, blocks: int) -> int:
        """Give back up to `blocks` blocks of the pool; returns how many (none for copies)."""
        return 0


@dataclass(frozen=True)
class _Shared:
    parent: int | None
    tokens: tuple[int, ...]
    block: int  # the pool block holding this prompt block's keys/values (this cache holds a reference)


class PagedPrefixCache(PrefixCache):
    """The same cache over a paged pool: entries are references to the rows' own full blocks."""

    cache: PagedKVCache

    def __init__(self, cache: PagedKVCache, budget_bytes: int) -> None:
        if cache.block != BLOCK:
            raise ValueError(f"the prefix cache needs {BLOCK}-token blocks, the pool has {cache.block}")
        super().__init__(cache, budget_bytes)

    def _block_bytes(self) -> int:
        return self.cache.block_bytes

    def load(self, prompt: Sequence[int], tokens: int, row: int, salt: str = "") -> None:
        """Row `row` (just reset) takes the cached blocks of the prompt's first `tokens`; the caller
        sets its length."""
        if tokens == 0:
            return
        chain = self._chain(prompt, tokens // BLOCK, salt)
        self._touch(chain)
        self.cache.share(row, [self._entries[key].block for key, _, _ in chain])

    def store(self, prompt: Sequence[int], row: int, salt: str = "") -> int:
        """Keep references to row `row`'s full blocks of `prompt` not cached yet (LRU past the budget)."""
        if self.capacity == 0:
            return 0
        chain = self._chain(prompt, min(len(prompt) // BLOCK, self.capacity), salt)
        table = self.cache.host_tables[row]
        added = 0
        for i, (key, parent, tokens) in enumerate(chain):
            if key not in self._entries:
                self._entries[key] = _Shared(parent, tokens, table[i])
                self.cache.ref(table[i])
                added += 1
        self._touch(chain)
        self._evict_past_capacity()
        return added

    def _drop(self, key: int) -> None:
        self.cache.unref(self._entries.pop(key).block)

    def _reclaimable(self, key: int) -> bool:
        """Only this cache holds the entry's block, and no admission counts on it."""
        entry = self._entries.get(key)
        return entry is not None and key not in self._pins and self.cache.refs(entry.block) == 1

    def reclaimable(self) -> int:
        return sum(1 for key in self._entries if self._reclaimable(key))

    def reclaim(self, blocks: int) -> int:
        """Evict least recently used unpinned entries whose block no row uses, until `blocks` are freed."""
        freed = 0
        for key in [k for k in self._entries if self._reclaimable(k)]:
            if freed >= blocks:
                break
            self._drop(key)
            freed += 1
        return freed

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)
