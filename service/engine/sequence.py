"""One request inside the engine: its sampling state, its output, and the text it may stream.

`SeqState.accept` takes each sampled token, decides whether the request is finished (stop
token, stop string, max_new_tokens) and streams the text that is safe to show: complete
characters (IncrementalDetokenizer), never a tail that may begin a stop string (stop_holdback).
`finish` releases what was held back, sends the last Delta and the Finished event, once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from models.decoding import Choice, RowSampler, SamplingParams, find_stop, stop_holdback
from models.text import IncrementalDetokenizer, TextTokenizer

from ..errors import GrammarFailed, ServiceError
from ..messages import FinishReason, TokenLogprob, Usage
from .events import Delta, Event, Finished, RequestHandle, Timing

# a row's sampled token, and (its log-probability, ((token id, log-probability) of the best k, best
# first)) when the request asked for log-probabilities
Picked = tuple[int, tuple[float, tuple[tuple[int, float], ...]] | None]


def picked(choice: Choice, index: Sequence[int], wanted: Sequence[int | None]) -> list[Picked]:
    """The rows `index` of a choice as Picked: each one's token and, where `wanted` (its request's
    `logprobs`, one per index) is not None, its log-probability and its best `wanted` alternatives."""
    ids = choice.tokens.tolist()
    if choice.logprobs is None:
        return [(ids[i], None) for i in index]
    chosen = choice.logprobs.tolist()
    top_ids = choice.top_ids.tolist() if choice.top_ids is not None else [[] for _ in ids]
    top_lp = choice.top_logprobs.tolist() if choice.top_logprobs is not None else [[] for _ in ids]
    return [(ids[i], None if k is None else (chosen[i], tuple(zip(top_ids[i][:k], top_lp[i][:k], strict=True))))
            for i, k in zip(index, wanted, strict=True)]

class SeqState:
    """Mutated by the engine thread only, except `cancelled` (set by cancel() from any thread)
    and the finish of a request cancelled while waiting (under the engine's lock)."""

    def __init__(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                 handle: RequestHandle, tokenizer: TextTokenizer, eos_ids: frozenset[int],
                 submitted: float, matcher: Any = None, adapter: int = -1, salt: str = "",
                 release: Callable[[], object] | None = None, adapter_name: str | None = None,
                 priority: int = 0, tenant: str | None = None) -> None:
        """`adapter`: its adapter's slot (-1: the base model), held until finish() calls `release`;
        `salt`: what its prefix-cache blocks are keyed under besides their tokens (its adapter's, its
        cache salt); `priority`: lower is sooner (vLLM's), admitted before and preempted after any
        request of a larger value; `tenant`: whose share of the queue it takes (None: nobody's)."""
        self.request_id = request_id
        self.priority, self.tenant = priority, tenant
        self.fault: ServiceError | None = None  # the request's own fault that ended it (engine/loop.py _fail)
        self.adapter, self.salt, self._release, self.adapter_name = adapter, salt, release, adapter_name
        self.prompt = list(prompt)
        self.params = params
        self.handle = handle
        self.sampler = RowSampler(params)
        self.matcher = matcher  # structured output: a grammar Matcher (engine/grammar.py), or None
        self.speculation: Any = None  # speculative decoding's state of it (engine/speculation/speculator.py)
        self.stop_ids = frozenset() if params.ignore_eos else eos_ids | frozenset(params.stop_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt=self.prompt)
        self.tokens: list[int] = []  # output without a final stop token
        self.tokenizer = tokenizer
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self._lp_sent = 0  # entries of `logprobs` already sent in a Delta
        self.n_sampled = 0  # tokens sampled, a final stop token included
        self.pending = -1  # the last sampled token: the next decode step's input (not yet in the cache)
        self.text = ""  # detokenized output so far (cut at a stop string once one is found)
        self.sent = 0  # characters of `text` already streamed
        self.submitted = submitted
        self.admitted: float | None = None  # set (under the engine lock) when taken for prefill
        self.cached_tokens = 0  # prompt tokens not computed for it: a prefix cache hit, or a sibling's row
        self.token_times: list[float] = []
        self.reason: FinishReason | None = None  # decided by accept(); sent by finish()
        self.cancelled = False
        self.closed = False  # Finished was sent
        self.resume = False  # preempted (paged cache out of blocks): its context is recomputed when admitted again
        self._cut = False  # text was cut at a stop string: nothing after it is ever shown

    @property
    def context(self) -> list[int]:
        """The tokens its cache rows hold while it runs: the prompt, and once preempted the output too,
        but the pending token (the next step's input)."""
        return self.prompt + self.tokens[:-1] if self.resume else self.prompt

    @property
    def done(self) -> bool:
        """The row can be freed: finished, cancelled, or already closed by an error."""
        return self.reason is not None or self.cancelled or self.closed

    def accept(self, token: int, now: float,
               logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None) -> None:
        """Take one sampled token (same stopping rules, in the same order, as models.generate), with
        its log-probability and the best alternatives' when the request asked for them."""
        self.n_sampled += 1
        self.token_times.append(now - self.submitted)
        self.pending = token
        if self.matcher is not None and not self.matcher.accept_token(token):  # masks allow only what it accepts
            raise GrammarFailed(f"the structured output's grammar failed after {len(self.tokens)} tokens "
                                f"(token {token}): {self.matcher.error()}", "response_format")
        if token in self.stop_ids:
            self.reason = "stop"
            return
        self.tokens.append(token)
        start = len(self.text)
        self.text += self.detok.push(token)
        if self.logprobs is not None and logprobs is not None:
            chosen, top = logprobs
            self.logprobs.append(TokenLogprob(self._piece(token), chosen,
                                              tuple((self._piece(t), lp) for t, lp in top),
                                              tuple(self.tokenizer.token_bytes(token)), start))
        stops = self.params.stop
        if stops:
            at = find_stop(self.text, stops, self.sent)  # nothing before `sent` can begin a stop
            if at >= 0:
                self.text, self._cut, self.reason = self.text[:at], True, "stop"
                if self.logprobs:  # the tokens of the stop string (and after) are not part of the answer
                    self.logprobs = [e for e in self.logprobs if e.offset < at]
                    self._lp_sent = min(self._lp_sent, len(self.logprobs))
                return
        if len(self.tokens) >= self.params.max_new_tokens:
            self.reason = "length"
            return
        safe = len(self.text) - (stop_holdback(self.text, stops) if stops else 0)
        if safe > self.sent:
            self._emit(Delta(self.text[self.sent:safe], self.n_sampled, self._new_logprobs(safe)))
            self.sent = safe
        elif self.n_sampled == 1:  # the first token, with no text to show yet: say it was sampled
            self._emit(Delta("", self.n_sampled))

    def _piece(self, token: int) -> str:
        """A token's own text (special tokens shown), as OpenAI lists tokens with their log-probabilities."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _new_logprobs(self, upto: int | None = None) -> tuple[TokenLogprob, ...]:
        """Entries not sent yet whose token's text starts before character `upto` (None: all): a
        token held back (it may begin a stop string) goes out with its text."""
        if not self.logprobs:
            return ()
        end = len(self.logprobs)
        if upto is not None:
            while end > self._lp_sent and self.logprobs[end - 1].offset >= upto:
                end -= 1
        new, self._lp_sent = tuple(self.logprobs[self._lp_sent:end]), end
        return new

    def finish(self, reason: FinishReason, now: float, error: str | None = None) -> Finished:
        """Send the rest of the text and the Finished event. `reason` applies unless accept()
        already decided one (an error always wins). Call once."""
        if self.closed:
            raise RuntimeError(f"request {self.request_id} is already finished")
        final: FinishReason = reason if error is not None or self.reason is None else self.reason
        if not self._cut and error is None:
            self.text += self.detok.flush()  # an incomplete last character, as decode() shows it
        self.closed, self.reason = True, final  # after flush: if it raises, finish("error") still can
        if self._release is not None:
            self._release, release = None, self._release
            release()
        if len(self.text) > self.sent or (self.logprobs and self._lp_sent < len(self.logprobs)):
            self._emit(Delta(self.text[self.sent:], self.n_sampled, self._new_logprobs()))
            self.sent = len(self.text)
        times = tuple(self.token_times)
        timing = Timing(queued_s=None if self.admitted is None else self.admitted - self.submitted,
                        first_token_s=times[0] if times else None, total_s=now - self.submitted,
                        token_times_s=times)
        fault = self.fault
        event = Finished(self.request_id, self.text[:self.sent], tuple(self.tokens), final,
                         Usage(len(self.prompt), self.n_sampled), timing, error,
                         None if self.logprobs is None else tuple(self.logprobs), self.adapter_name,
                         None if fault is None else fault.type, None if fault is None else fault.param)
        self._emit(event)
        return event

    def _emit(self, event: Event) -> None:
        if not self.handle.deliver(event):
            self.cancelled = True  # the caller's event loop is gone: stop generating for it
