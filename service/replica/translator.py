"""Translation on one encoder-decoder replica, each input with its own beam size and length limit,
scheduled one of two ways (the deployment's `translation.scheduler`):
- `TranslatorEngineRunner` ("steps", the default): the translation engine (service/engine/translation.py),
  where requests join and leave the search at every decoder step;
- `TranslatorRunner` ("batches"): beam search over dynamic batches, each run to its end
  (models.beam_search.translate_ids takes one BeamParams per source).

What differs between translators is carried by the model and its tokenizer, not decided here: the
start, end and pad ids come from the model's config, the text from its tokenizer, and a task prefix
(T5's "translate English to German: ") from the config's translation_prefixes for the languages the
spec serves, or from the spec's `prefix` default.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from models.beam_search import BeamParams, translate_ids
from models.catalog import LoadedModel

from ..common.streams import interleaved
from ..engine.config import TranslationConfig
from ..engine.events import Finished
from ..engine.translation import TranslationEngine, TranslationSubmission
from ..errors import DeadlineExceeded, InternalError, InvalidRequest
from ..messages import TextDelta, TranslateOptions, TranslationDone
from ..telemetry.hooks import BatchObserver, EngineObserver
from ..telemetry.metrics import ServiceMetrics
from ..telemetry.observers import PrometheusEngineObserver
from .batcher import STOPPED
from .config import BatchLimits
from .heap import HeapTrimmer
from .runner import BatchedRunner, EngineRunner, ModelRunner, chars, deadline, off_loop
from .tokenize import tokenize

if TYPE_CHECKING:
    from ..settings import DeploymentSettings


@dataclass(frozen=True)
class TranslateItem:
    ids: list[int]
    params: BeamParams


def source_prefix(loaded: LoadedModel) -> str:
    """The text put before every input: the spec's `prefix` default if it has one, else the model's task
    prefix for the served (source, target) languages, else none. A model that names task prefixes but
    none for the served pair cannot know what it is asked: ValueError at load, naming the pairs it has."""
    spec, cfg = loaded.spec, loaded.model.cfg
    if "prefix" in spec.defaults:
        return str(spec.defaults["prefix"])
    known = getattr(cfg, "translation_prefixes", ())
    if not known or spec.languages is None:
        return ""
    prefix = cfg.translation_prefix(*spec.languages)
    if prefix is None:
        pairs = sorted(f"{s}->{t}" for s, t, _ in known)
        raise ValueError(f"model {spec.name!r} has task prefixes for {pairs}, none for "
                         f"{spec.languages[0]}->{spec.languages[1]}; serve one of those pairs or set "
                         "defaults.prefix in its model spec")
    return prefix


def banned_ids(loaded: LoadedModel) -> list[int]:
    """Tokens a translation never produces: pad and the decoder's start token (unless it is eos)."""
    cfg = loaded.model.cfg
    return sorted({t for t in (cfg.pad_token_id, cfg.decoder_start_token_id) if t is not None} - {cfg.eos_token_id})


def beam_params(loaded: LoadedModel, options: TranslateOptions) -> BeamParams:
    """The request's search, its model's defaults where it sets nothing; a 422 past the model's length."""
    defaults, limit = loaded.spec.defaults, loaded.model.cfg.max_positions - 1
    beam = options.beam_size or int(defaults.get("beam_size", 4))
    max_new = options.max_new_tokens or int(defaults.get("max_new_tokens", 128))
    if max_new > limit:
        raise InvalidRequest(f"max_new_tokens is {max_new}; model {loaded.spec.name!r} can generate "
                             f"at most {limit}", "max_new_tokens")
    return BeamParams(beam_size=beam, max_new_tokens=max_new)


def for_translator(loaded: LoadedModel, deployment: str, settings: DeploymentSettings,
                   metrics: ServiceMetrics) -> ModelRunner:
    """The runner its `translation.scheduler` names."""
    if settings.translation.scheduler == "batches":
        return TranslatorRunner.for_deployment(loaded, deployment, settings, metrics)
    return TranslatorEngineRunner(loaded, deployment, settings.translation,
                                  PrometheusEngineObserver(metrics, loaded.spec.name),
                                  HeapTrimmer(settings.heap_trim_interval_s))


class TranslatorRunner(BatchedRunner):
    """Beam search on the encoder-decoder; each item keeps its own beam size and length limit inside
    a shared batch (translate_ids takes one BeamParams per source)."""

    def __init__(self, loaded: LoadedModel, deployment: str, limits: BatchLimits,
                 observer: BatchObserver | None = None, heap: HeapTrimmer | None = None) -> None:
        super().__init__(loaded, deployment, limits, observer, heap)
        self.banned = banned_ids(loaded)
        self.prefix = source_prefix(loaded)

    def params(self, options: TranslateOptions) -> BeamParams:
        return beam_params(self.loaded, options)

    async def translate(self, texts: Sequence[str], options: TranslateOptions,
                        timeout_s: float | None, priority: int = 0) -> list[str]:
        params = self.params(options)
        prefixed = [self.prefix + t for t in texts]
        ids = await off_loop(chars(prefixed), tokenize, self.loaded.tokenizer, prefixed,
                             self.loaded.max_input_tokens, options.truncate)
        return await self.batcher.submit_many([TranslateItem(x, params) for x in ids], [len(x) for x in ids],
                                              deadline(timeout_s), [params.beam_size * params.max_new_tokens] * len(ids),
                                              priority=priority)

    async def translate_stream(self, texts: Sequence[str], options: TranslateOptions, timeout_s: float | None,
                               priority: int = 0) -> AsyncIterator[tuple[int, TextDelta | TranslationDone]]:
        """translate()'s answers as a stream (request-level batches have no pieces: each text whole, at the end)."""
        for i, text in enumerate(await self.translate(texts, options, timeout_s, priority)):
            yield i, TextDelta(text)
            yield i, TranslationDone(text)

    def run_batch(self, payloads: list[TranslateItem]) -> list[str | object]:
        """One beam search over the batch; an input no longer wanted (its client went away, its deadline
        passed) leaves the search at the next step (STOPPED), freeing its rows for the others."""
        out = translate_ids(self.loaded.executor, [p.ids for p in payloads], [p.params for p in payloads],
                            banned_ids=self.banned, cancelled=lambda i: not self.batcher.still_wanted(payloads[i]))
        texts = iter(self.loaded.tokenizer.decode_batch([ids for ids in out if ids is not None]))
        return [STOPPED if ids is None else next(texts) for ids in out]

    def warm_up(self) -> None:
        ids = tokenize(self.loaded.tokenizer, [self.prefix + "warm up", self.prefix + "warm up the translator"],
                       self.loaded.max_input_tokens, truncate=True)
        self.run_batch([TranslateItem(ids[0], BeamParams(1, 2)), TranslateItem(ids[1], BeamParams(2, 2))])


WARM_UP = ("warm up", "warm up the translator")
WARM_UP_STEPS = 4


class TranslatorEngineRunner(EngineRunner):
    """The translation engine for one encoder-decoder: requests join the beam search at the next
    decoder step and leave it at the step they end; a request whose caller goes away or whose
    deadline passes is cancelled in the engine, which frees its rows within one step."""

    loop_name = "translation engine"

    def __init__(self, loaded: LoadedModel, deployment: str, config: TranslationConfig,
                 observer: EngineObserver | None = None, heap: HeapTrimmer | None = None) -> None:
        super().__init__(loaded, deployment, heap)
        self.config = config
        self.prefix = source_prefix(loaded)
        self.engine = TranslationEngine(loaded.executor, loaded.tokenizer, config.max_rows,
                                        loaded.model.cfg.max_positions - 1, config.max_queued, config.encode_tokens,
                                        banned_ids(loaded), observer, name=f"{deployment}-engine",
                                        after_step=self.heap.maybe_trim)

    def params(self, options: TranslateOptions) -> BeamParams:
        return beam_params(self.loaded, options)

    async def _submit(self, texts: Sequence[str], options: TranslateOptions, timeout_s: float | None,
                      priority: int = 0) -> list[Any]:
        """Every text submitted to the engine together, at `priority` (lower is sooner): their handles."""
        params = self.params(options)
        if params.beam_size > self.config.max_rows:
            raise InvalidRequest(f"beam_size is {params.beam_size}; this deployment decodes at most "
                                 f"{self.config.max_rows} beams at once", "beam_size")
        prefixed = [self.prefix + t for t in texts]
        ids = await off_loop(chars(prefixed), tokenize, self.loaded.tokenizer, prefixed,
                             self.loaded.max_input_tokens, options.truncate)
        until = None if timeout_s is None else time.perf_counter() + timeout_s
        return self.engine.submit_many([TranslationSubmission(x, params, deadline=until, priority=priority)
                                        for x in ids])

    async def translate(self, texts: Sequence[str], options: TranslateOptions,
                        timeout_s: float | None, priority: int = 0) -> list[str]:
        """Every text's translation. Past `timeout_s` the unfinished ones are cancelled: DeadlineExceeded."""
        handles = await self._submit(texts, options, timeout_s, priority)
        try:
            finished = await asyncio.wait_for(asyncio.gather(*(handle.result() for handle in handles)), timeout_s)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
            for handle in handles:
                handle.cancel()
            raise DeadlineExceeded(f"the translation did not finish within {timeout_s:.1f} s") from None
        except asyncio.CancelledError:
            for handle in handles:
                handle.cancel()
            raise
        if any(event.error is not None for event in finished):
            raise InternalError(f"{self.deployment}: the translation failed; see the server log")
        return [event.text for event in finished]

    async def translate_stream(self, texts: Sequence[str], options: TranslateOptions, timeout_s: float | None,
                               priority: int = 0) -> AsyncIterator[tuple[int, TextDelta | TranslationDone]]:
        """(index of the text, event) as the engine produces them: a greedy translation's pieces of text
        as its tokens are chosen, a beam search's text whole when it ends; then TranslationDone per
        text. `timeout_s` only bounds the wait for rows (admission): the caller decides how long it
        reads. Closing the stream, or cancelling the task reading it, cancels the unfinished texts."""
        handles = await self._submit(texts, options, timeout_s, priority)
        ended = [False] * len(handles)
        try:
            async for i, event in interleaved(handles):
                if not isinstance(event, Finished):
                    if event.text:
                        yield i, TextDelta(event.text)
                    continue
                ended[i] = True
                if event.error is not None or event.finish_reason == "cancelled":
                    raise InternalError(f"{self.deployment}: the translation failed; see the server log")
                yield i, TranslationDone(event.text)
        finally:
            for handle, done in zip(handles, ended, strict=True):
                if not done:
                    handle.cancel()

    def warm_up(self) -> None:
        """A greedy and a beam search on the engine, before start() (the engine thread is not running)."""
        ids = tokenize(self.loaded.tokenizer, [self.prefix + t for t in WARM_UP], self.loaded.max_input_tokens,
                       truncate=True)
        self.engine.submit_many([TranslationSubmission(ids[0], BeamParams(1, 2)),
                                 TranslationSubmission(ids[1], BeamParams(2, 2))])
        self.warm_up_steps(WARM_UP_STEPS, "the warm-up translations")

    @property
    def queue_capacity(self) -> int:
        return self.config.max_queued

    def stats(self) -> dict[str, Any]:
        # as a generator's (running: rows reserved, generated_tokens: rows decoded), and the most
        # requests one decoder step advanced
        return {**super().stats(), "largest_batch": self.engine.largest_step}

    def limits(self) -> dict[str, Any]:
        return {"scheduler": "steps", "max_rows": self.config.max_rows, "max_queued": self.config.max_queued}

