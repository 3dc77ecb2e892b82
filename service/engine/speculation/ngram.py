"""Prompt lookup (draft-free speculation): a request's next tokens proposed from its own tokens. The
longest of its last n tokens (ngram_max down to ngram_min) that occurred earlier in its prompt or
output proposes what followed that latest earlier occurrence. State per request, nothing shared."""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookup:
    """An index of a sequence's n-grams to where the latest occurrence of each was followed. `extend`
    takes tokens as they come (O(ngram_max) each); `propose` is O(ngram_max)."""

    def __init__(self, n_min: int, n_max: int, tokens: Sequence[int] = ()) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._follows: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]  # n -> gram -> next index
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens: each n-gram that ends before a new token is indexed as followed by it."""
        seq = self.tokens
        for token in tokens:
            at = len(seq)  # the new token's index: the grams ending just before it are followed by it
            seq.append(token)
            for n in range(self.n_min, min(self.n_max, at) + 1):
                self._follows[n][tuple(seq[at - n:at])] = at

    def propose(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest matching suffix; [] when
        no suffix of ngram_min..ngram_max tokens occurred before. Where what followed runs into the end
        of the sequence (a loop of period P = end - occurrence), it goes on as the loop would. `after`:
        tokens taken as the sequence's continuation (not indexed), e.g. drafts not yet verified."""
        seq, known = self.tokens, len(self.tokens)
        end = known + len(after)

        def token(i: int) -> int:
            return seq[i] if i < known else after[i - known]

        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            at = self._follows[n].get(tuple(token(i) for i in range(end - n, end)))
            if at is not None:
                period = end - at
                return [token(at + i % period) for i in range(k)]
        return []
