"""Structured outputs: token masks from llguidance, so the text always matches the request's JSON
schema, regex or Lark grammar (no retries). No Ray, no FastAPI.

llguidance rather than the faster xgrammar, whose length-bounded strings may hold raw control
characters (invalid JSON) (docs/benchmarks.md, "Smaller figures"). `Grammars` (one per engine) turns
a GrammarSpec into a validated grammar (cached by source) and makes a matcher per request. Each step,
the rows with a matcher get their allowed-token mask (B, V) bool, True = allowed, computed on a
worker thread during the forward pass (llguidance releases the GIL); the sampler masks the logits
with it, and each matcher then consumes its row's token.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from models.text import TextTokenizer

from ..errors import InvalidRequest
from ..messages import GrammarSpec

_BITS = torch.arange(32, dtype=torch.int32)  # bit positions of one int32 bitmask word
ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object (OpenAI's JSON mode)
# canonical whitespace (", " and ": "): a model cannot loop on blanks inside the JSON
JSON_OPTIONS = {"whitespace_flexible": False}
CACHED_GRAMMARS = 256  # distinct sources kept compiled


class Grammars:
    """Compiles GrammarSpecs against the model's tokenizer and vocabulary (thread-safe)."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_ids: frozenset[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def _lltokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built on first use (it scans the vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(self.tokenizer.tok.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=self.stop_ids or None)
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> str:
        """The validated grammar of `spec`; InvalidRequest naming spec.field when llguidance refuses it."""
        import llguidance

        key = (spec.kind, spec.source)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        tok = self._lltokenizer()
        try:
            if spec.kind in ("json_object", "json_schema"):
                schema = ANY_OBJECT if spec.kind == "json_object" else spec.source
                json.loads(schema)  # a clearer message than the library's for bad JSON
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            elif spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.source)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.source)
            error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        except ValueError as e:
            error = str(e)
        if error:
            message = error.strip().splitlines()[0][:300]
            raise InvalidRequest(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {message}", spec.field)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> Matcher:
        import llguidance

        return Matcher(llguidance.LLMatcher(self._lltokenizer(), grammar, log_level=0))


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def accept_token(self, token: int) -> bool:
        """Consume the sampled token; False when the grammar refuses it (the mask should have prevented it)."""
        return bool(self.inner.consume_token(token)) and not self.inner.is_error()

    def error(self) -> str:
        return self.inner.get_error() if self.inner.is_error() else ""


class MaskBuilder:
    """Fills the allowed-token masks of a batch's constrained rows (one buffer, reused)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor: Any = None
        self._bitmask: Tensor | None = None

    def masks(self, matchers: list[Matcher | None]) -> Tensor | None:
        """(B, V) bool, True = allowed, for rows in order (unconstrained rows allow everything); None
        when no row has a matcher."""
        rows = [(m.inner, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        import llguidance
        import llguidance.torch as llt

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        b = len(matchers)
        if self._bitmask is None or self._bitmask.size(0) < b:
            self._bitmask = llt.allocate_token_bitmask(max(b, 8), self.vocab_size)  # (R, W) int32
        bitmask = self._bitmask[:b]  # (B, W) contiguous rows
        bitmask.fill_(-1)  # every bit set: unconstrained rows allow all tokens
        llt.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        bits = (bitmask[:, :, None] >> _BITS) & 1  # (B, W, 32)
        return bits.reshape(b, -1)[:, :self.vocab_size].bool()  # (B, V)
