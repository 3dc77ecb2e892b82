"""Translation on one encoder-decoder replica: beam search over dynamic batches, each input with its
own beam size and length limit (models.beam_search.translate_ids takes one BeamParams per source).

What differs between translators is carried by the model and its tokenizer, not decided here: the
start, end and pad ids come from the model's config, the text from its tokenizer, and a task prefix
(T5's "translate English to German: ") from the config's translation_prefixes for the languages the
spec serves, or from the spec's `prefix` default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from models.beam_search import BeamParams, translate_ids
from models.catalog import LoadedModel

from ..errors import InvalidRequest
from ..messages import TranslateOptions
from ..telemetry.hooks import BatchObserver
from .batcher import STOPPED
from .config import BatchLimits
from .heap import HeapTrimmer
from .runner import BatchedRunner, chars, deadline, off_loop
from .tokenize import tokenize


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


class TranslatorRunner(BatchedRunner):
    """Beam search on the encoder-decoder; each item keeps its own beam size and length limit inside
    a shared batch (translate_ids takes one BeamParams per source)."""

    def __init__(self, loaded: LoadedModel, deployment: str, limits: BatchLimits,
                 observer: BatchObserver | None = None, heap: HeapTrimmer | None = None) -> None:
        super().__init__(loaded, deployment, limits, observer, heap)
        cfg = loaded.model.cfg
        self.banned = sorted({t for t in (cfg.pad_token_id, cfg.decoder_start_token_id) if t is not None}
                             - {cfg.eos_token_id})
        self.max_new_limit = cfg.max_positions - 1
        self.prefix = source_prefix(loaded)

    def params(self, options: TranslateOptions) -> BeamParams:
        defaults = self.loaded.spec.defaults
        beam = options.beam_size or int(defaults.get("beam_size", 4))
        max_new = options.max_new_tokens or int(defaults.get("max_new_tokens", 128))
        if max_new > self.max_new_limit:
            raise InvalidRequest(f"max_new_tokens is {max_new}; model {self.loaded.spec.name!r} can generate "
                                 f"at most {self.max_new_limit}", "max_new_tokens")
        return BeamParams(beam_size=beam, max_new_tokens=max_new)

    async def translate(self, texts: Sequence[str], options: TranslateOptions,
                        timeout_s: float | None) -> list[str]:
        params = self.params(options)
        prefixed = [self.prefix + t for t in texts]
        ids = await off_loop(chars(prefixed), tokenize, self.loaded.tokenizer, prefixed,
                             self.loaded.max_input_tokens, options.truncate)
        return await self.batcher.submit_many([TranslateItem(x, params) for x in ids], [len(x) for x in ids],
                                              deadline(timeout_s), [params.beam_size * params.max_new_tokens] * len(ids))

    def run_batch(self, payloads: list[TranslateItem]) -> list[str | object]:
        """One beam search over the batch; an input no longer wanted (its client went away, its deadline
        passed) leaves the search at the next step (STOPPED), freeing its rows for the others."""
        out = translate_ids(self.loaded.model, [p.ids for p in payloads], [p.params for p in payloads],
                            banned_ids=self.banned, cancelled=lambda i: not self.batcher.still_wanted(payloads[i]))
        texts = iter(self.loaded.tokenizer.decode_batch([ids for ids in out if ids is not None]))
        return [STOPPED if ids is None else next(texts) for ids in out]

    def warm_up(self) -> None:
        ids = tokenize(self.loaded.tokenizer, [self.prefix + "warm up", self.prefix + "warm up the translator"],
                       self.loaded.max_input_tokens, truncate=True)
        self.run_batch([TranslateItem(ids[0], BeamParams(1, 2)), TranslateItem(ids[1], BeamParams(2, 2))])
