"""Translation on one encoder-decoder replica: beam search over dynamic batches, each input with its
own beam size and length limit (models.beam_search.translate_ids takes one BeamParams per source)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from models.beam_search import BeamParams, translate_ids
from models.catalog import LoadedModel

from ..errors import InvalidRequest
from ..messages import TranslateOptions
from ..telemetry.hooks import BatchObserver
from .config import BatchLimits
from .heap import HeapTrimmer
from .runner import BatchedRunner, deadline
from .tokenize import tokenize


@dataclass(frozen=True)
class TranslateItem:
    ids: list[int]
    params: BeamParams


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
        ids = tokenize(self.loaded.tokenizer, texts, self.loaded.max_input_tokens, options.truncate)
        return await self.batcher.submit_many([TranslateItem(x, params) for x in ids], [len(x) for x in ids],
                                              deadline(timeout_s))

    def run_batch(self, payloads: list[TranslateItem]) -> list[str]:
        out = translate_ids(self.loaded.model, [p.ids for p in payloads], [p.params for p in payloads],
                            banned_ids=self.banned)
        return self.loaded.tokenizer.decode_batch(out)

    def warm_up(self) -> None:
        ids = tokenize(self.loaded.tokenizer, ["warm up", "warm up the translator"],
                       self.loaded.max_input_tokens, truncate=True)
        self.run_batch([TranslateItem(ids[0], BeamParams(1, 2)), TranslateItem(ids[1], BeamParams(2, 2))])
