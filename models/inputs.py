"""Model inputs from token lists: the one right-padding, keep-mask and seen-token helper.

Every caller that feeds several sequences to a model at once goes through here: the encoder
batcher and the generation engine in the service, models/generate.py (prefill) and
models/beam_search.py (sources). `select_batch` is the cost model that decides which sequences
are padded together.

    B batch, T padded length, V vocabulary
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PaddedBatch:
    """Token lists right-padded into one tensor; `keep` is True on real tokens."""

    ids: Tensor  # (B, T) long
    keep: Tensor  # (B, T) bool
    lengths: tuple[int, ...]  # (B,) real tokens per row

    @classmethod
    def from_token_lists(cls, seqs: Sequence[Sequence[int]], pad_id: int = 0, device: torch.device | str = "cpu",
                         multiple: int = 1, limit: int | None = None) -> PaddedBatch:
        """Right-pad to the longest row, T rounded up to a multiple of `multiple` but not past
        `limit` (nor below the longest). Raises ValueError for no rows or an empty row."""
        if not seqs or any(len(s) == 0 for s in seqs):
            raise ValueError("a padded batch needs at least one row and at least one token per row")
        lengths = tuple(len(s) for s in seqs)
        longest = max(lengths)
        t = -(-longest // multiple) * multiple
        if limit is not None:
            t = max(longest, min(t, limit))
        ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)  # (B, T)
        for i, s in enumerate(seqs):
            ids[i, : lengths[i]] = torch.as_tensor(list(s), dtype=torch.long)
        keep = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
        return cls(ids.to(device), keep.to(device), lengths)

    def pad(self, rows: Sequence[Sequence[int] | None], value: int = 0) -> Tensor:
        """Per-token values of the same rows (e.g. token type ids) laid out like `ids`: (B, T) long,
        `value` at padding and for a row given as None. Each row given has its row's length."""
        out = torch.full(tuple(self.ids.shape), value, dtype=torch.long)  # (B, T)
        for i, row in enumerate(rows):
            if row is not None:
                if len(row) != self.lengths[i]:
                    raise ValueError(f"row {i} has {len(row)} values for {self.lengths[i]} tokens")
                out[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        return out.to(self.ids.device)

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def computed_tokens(self) -> int:
        return self.ids.numel()

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.computed_tokens

    def last_index(self) -> Tensor:
        """(B,) index of each row's last real token."""
        return self.keep.sum(-1) - 1

    def mark_seen(self, seen: Tensor) -> Tensor:
        """Set seen[b, v] for every real token v of row b (pad ids may be real tokens, so only
        positions under `keep` count). `seen`: (B, V) bool, modified in place and returned."""
        rows = torch.arange(self.ids.size(0), device=self.ids.device)[:, None].expand_as(self.ids)  # (B, T)
        seen[rows[self.keep], self.ids[self.keep]] = True
        return seen


def select_batch(lengths: Sequence[int], max_batch_size: int, max_batch_tokens: int,
                 overhead_tokens: int = 32) -> list[int]:
    """Indices (in queue order) of the next batch from a queue of item lengths, oldest first.

    Cost model: a batch of k rows padded to `longest` costs `overhead_tokens + k * longest`
    token-steps (the overhead stands for the fixed cost of a forward pass); an item's ideal cost is
    its length plus its share of a full batch's overhead. The batch holds index 0 (the oldest item,
    so nobody starves) plus a run of items next to it in length order; of the runs that fit
    (k <= max_batch_size, `k * longest <= max_batch_tokens`) it takes the one with the least excess
    cost per item, excess = padding + the overhead share of the empty slots (older items first on
    ties). A full batch is thus the run with the least padding, and a short item is padded to a long
    one only when that costs less than a smaller batch.
    """
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda j: (lengths[j], j))  # by length
    pos = order.index(0)
    length_sum, index_sum = [0], [0]  # prefix sums over `order`
    for j in order:
        length_sum.append(length_sum[-1] + lengths[j])
        index_sum.append(index_sum[-1] + j)

    def empty_slots(k: int) -> float:
        return overhead_tokens * (1 - k / max_batch_size)

    best = (empty_slots(1), 0, pos, 1)  # (excess per item, index sum, start, k): the oldest alone
    for k in range(2, min(max_batch_size, len(lengths)) + 1):
        for start in range(max(0, pos - k + 1), min(pos, len(order) - k) + 1):
            longest = lengths[order[start + k - 1]]
            if k * longest > max_batch_tokens:
                continue
            padding = k * longest - (length_sum[start + k] - length_sum[start])
            key = ((empty_slots(k) + padding) / k, index_sum[start + k] - index_sum[start], start, k)
            best = min(best, key)
    _, _, start, k = best
    return sorted(order[start: start + k])
