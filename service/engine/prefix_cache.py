"""Automatic prefix caching for the engine: the keys/values of prompt blocks already computed, kept
by content so a new request with the same beginning (a system prompt, a chat history, n > 1
siblings arriving apart) copies them into its cache row and prefills only the rest.

A prompt is cut into blocks of BLOCK tokens; a full block is addressed by a chain hash (its tokens
and the hash of the block before it), so a block is reused only after the same whole prefix (as
vLLM's automatic prefix caching). Entries keep their tokens and their parent's hash, compared on
lookup, so a hash collision can never serve another prompt's keys. A hit is at most the prompt's length - 1 (the last prompt token
is always computed: its logits give the first sampled token). Entries are evicted least recently
used once the budget is spent. Loading is a copy into a row of the engine's dense KV cache
(models.kv_cache.KVCache), storing a copy out of it: no change to the model or its cache layout.

The engine thread owns it (no locks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from models.kv_cache import KVCache

BLOCK = 16  # tokens per cached block


@dataclass(frozen=True)
class _Entry:
    parent: int | None  # the chain hash of the block before (None: the first block)
    tokens: tuple[int, ...]  # this block's BLOCK tokens
    kv: Tensor  # (2 * layers, K, BLOCK, D): keys then values of every layer


class PrefixCache:
    """Full prompt blocks' keys/values, content-addressed, LRU within `budget_bytes`."""

    def __init__(self, cache: KVCache, budget_bytes: int) -> None:
        self.cache = cache
        k = cache.k[0]
        self.block_bytes = 2 * len(cache.k) * k.size(1) * BLOCK * k.size(3) * k.element_size()
        self.capacity = budget_bytes // self.block_bytes  # blocks
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # chain hash -> entry, least recent first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return len(self._entries) * self.block_bytes

    @staticmethod
    def _chain(prompt: Sequence[int], blocks: int) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """(chain hash, parent's chain hash, tokens) of the prompt's first `blocks` full blocks."""
        chain, parent = [], None
        for i in range(blocks):
            tokens = tuple(prompt[i * BLOCK:(i + 1) * BLOCK])
            key = hash((parent, tokens))
            chain.append((key, parent, tokens))
            parent = key
        return chain

    def lookup(self, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` whose keys/values are cached (a multiple of BLOCK, < len(prompt))."""
        if self.capacity == 0:
            return 0
        hit = 0
        for key, parent, tokens in self._chain(prompt, (len(prompt) - 1) // BLOCK):
            entry = self._entries.get(key)
            if entry is None or entry.parent != parent or entry.tokens != tokens:
                break
            hit += BLOCK
        return hit

    def load(self, prompt: Sequence[int], tokens: int, row: int) -> None:
        """Copy the cached keys/values of the prompt's first `tokens` (a lookup() result) into slots
        [0, tokens) of cache row `row`; the caller sets the row's length."""
        if tokens == 0:
            return
        chain = self._chain(prompt, tokens // BLOCK)
        self._touch(chain)
        kv = torch.stack([self._entries[key].kv for key, _, _ in chain], dim=2)  # (2 * layers, K, n, BLOCK, D)
        kv = kv.flatten(2, 3)  # (2 * layers, K, tokens, D)
        n_layers = len(self.cache.k)
        for i in range(n_layers):
            self.cache.k[i][row, :, :tokens] = kv[i]  # (K, tokens, D)
            self.cache.v[i][row, :, :tokens] = kv[n_layers + i]  # (K, tokens, D)

    def store(self, prompt: Sequence[int], row: int) -> int:
        """Keep the full blocks of `prompt`, whose keys/values are in slots [0, len) of cache row
        `row`, that are not cached yet; evict least recently used blocks past the budget. Returns
        the blocks added."""
        if self.capacity == 0:
            return 0
        chain = self._chain(prompt, min(len(prompt) // BLOCK, self.capacity))
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
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return len(new)

    def _touch(self, chain: list[tuple[int, int | None, tuple[int, ...]]]) -> None:
        """Mark a chain's blocks recently used, the first block most recently: eviction then takes a
        prefix's last blocks before its first ones, never leaving unreachable blocks behind."""
        for key, _, _ in reversed(chain):
            if key in self._entries:
                self._entries.move_to_end(key)

    def clear(self) -> None:
        self._entries.clear()
