"""Classification and embeddings on one encoder replica: tokenize on the event loop (lengths group
and budget the batch), batch dynamically, one forward pass for both tasks, results as the plain
dataclasses of service/messages.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from models.catalog import LoadedModel
from models.inputs import PaddedBatch

from ..messages import Classification, Embeddings
from ..telemetry.hooks import BatchObserver
from .config import BatchLimits
from .heap import HeapTrimmer
from .runner import BatchedRunner, deadline
from .tokenize import tokenize


@dataclass(frozen=True)
class EncodeItem:
    ids: list[int]
    classify: bool  # else: embedding


class EncoderRunner(BatchedRunner):
    """Classification and embeddings on one encoder; both tasks share batches (one forward pass)."""

    def __init__(self, loaded: LoadedModel, deployment: str, limits: BatchLimits,
                 observer: BatchObserver | None = None, heap: HeapTrimmer | None = None) -> None:
        super().__init__(loaded, deployment, limits, observer, heap)
        if "classify" in loaded.spec.tasks and not loaded.labels:
            raise ValueError(f"model {loaded.spec.name!r} serves classify but has no classification head "
                             "(set `head` in its model settings)")
        pad = loaded.model.cfg.pad_token_id
        self.pad_id = pad if pad is not None else 0

    async def classify(self, texts: Sequence[str], truncate: bool, timeout_s: float | None) -> list[Classification]:
        ids = tokenize(self.loaded.tokenizer, texts, self.loaded.max_input_tokens, truncate)
        return await self.batcher.submit_many([EncodeItem(x, True) for x in ids], [len(x) for x in ids],
                                              deadline(timeout_s))

    async def embed(self, texts: Sequence[str], truncate: bool, timeout_s: float | None) -> Embeddings:
        ids = tokenize(self.loaded.tokenizer, texts, self.loaded.max_input_tokens, truncate)
        vectors = await self.batcher.submit_many([EncodeItem(x, False) for x in ids], [len(x) for x in ids],
                                                 deadline(timeout_s))
        return Embeddings(vectors, sum(len(x) for x in ids))

    @torch.inference_mode()
    def run_batch(self, payloads: list[EncodeItem]) -> list[Classification | list[float]]:
        model = self.loaded.model
        batch = PaddedBatch.from_token_lists([p.ids for p in payloads], self.pad_id, self.loaded.device)  # (B, T)
        pooled = model.embed(batch.ids, batch.keep)  # (B, C)
        rows = [i for i, p in enumerate(payloads) if p.classify]
        out: list[Any] = pooled.float().cpu().tolist()
        if rows:
            probs = model.head(pooled[rows]).float().softmax(-1).cpu()  # (b, n_labels)
            labels = self.loaded.labels
            for row, p in zip(rows, probs.tolist(), strict=True):
                best = max(range(len(p)), key=p.__getitem__)
                out[row] = Classification(labels[best], p[best], dict(zip(labels, p, strict=True)))
        return out

    def warm_up(self) -> None:
        tok = self.loaded.tokenizer
        texts = ["warm up", "a slightly longer sentence to warm up the encoder"]
        ids = tokenize(tok, texts, self.loaded.max_input_tokens, truncate=True)
        self.run_batch([EncodeItem(ids[0], bool(self.loaded.labels)), EncodeItem(ids[1], False)])
