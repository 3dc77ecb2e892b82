"""Classification, embeddings and reranking on one encoder replica: tokenize on the event loop
(lengths group and budget the batch), batch dynamically, one forward pass for every task, results as
the plain dataclasses of service/messages.py (a rerank score is a float)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from models.catalog import LoadedModel
from models.inputs import PaddedBatch

from ..errors import InvalidRequest
from ..messages import AdapterRef, Classification, Embeddings
from ..telemetry.hooks import BatchObserver
from .config import BatchLimits
from .heap import HeapTrimmer
from .runner import BatchedRunner, chars, deadline, off_loop
from .tokenize import tokenize, tokenize_pairs

Task = Literal["classify", "embed", "rerank"]


@dataclass(frozen=True)
class EncodeItem:
    ids: list[int]
    task: Task
    types: list[int] | None = None  # token type ids (a rerank pair's); None: all zeros
    raw: bool = False  # rerank: the pair's logit instead of its score
    slot: int = -1  # the LoRA adapter slot its request holds (-1: the base model)


class EncoderRunner(BatchedRunner):
    """Classification, embeddings and reranking on one encoder; every task shares batches (one
    forward pass). A reranker is a classification head with one output: the pair's relevance logit,
    scored by the head's own score function (EncoderModel.scores), as classification is."""

    def __init__(self, loaded: LoadedModel, deployment: str, limits: BatchLimits,
                 observer: BatchObserver | None = None, heap: HeapTrimmer | None = None) -> None:
        super().__init__(loaded, deployment, limits, observer, heap)
        if "classify" in loaded.spec.tasks and not loaded.labels:
            raise ValueError(f"model {loaded.spec.name!r} serves classify but has no classification head "
                             "(set `head` in its model settings)")
        if "rerank" in loaded.spec.tasks and len(loaded.labels) != 1:
            raise ValueError(f"model {loaded.spec.name!r} serves rerank, which needs a classification head with one "
                             f"output (a cross-encoder's relevance score); its head has {len(loaded.labels)}")
        cfg = loaded.model.cfg
        if "rerank" in loaded.spec.tasks and cfg.head_scores == "softmax":
            raise ValueError(f"model {loaded.spec.name!r} serves rerank, but its head scores by softmax, which is 1 "
                             "for every pair with one output (a cross-encoder's head scores by sigmoid)")
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.use_types = cfg.type_vocab_size > 1  # one type (RoBERTa) or none (DistilBERT): ids are all zero

    async def _submit(self, items: list[EncodeItem], adapter: AdapterRef | None, timeout_s: float | None,
                      priority: int = 0) -> list[Any]:
        """Items into the batcher at `priority` (lower is sooner), on `adapter`'s slot (held until their
        results are back)."""
        async with self.adapters.holding(adapter) as held:
            if held is not None:
                head = self.adapters.head(held.slot)
                if items and items[0].task == "rerank" and head is not None and len(head.labels) != 1:
                    raise InvalidRequest(f"adapter {held.name!r} has a classification head of {len(head.labels)} "
                                         "outputs; reranking needs one (a relevance score)", "model")
                items = [dataclasses.replace(item, slot=held.slot) for item in items]
            out = await self.batcher.submit_many(items, [len(item.ids) for item in items], deadline(timeout_s),
                                                 priority=priority)
            if held is not None and items:
                self.observer.on_adapter(held.name, items[0].task, len(items), sum(len(item.ids) for item in items))
            return out

    async def classify(self, texts: Sequence[str], truncate: bool, timeout_s: float | None,
                       adapter: AdapterRef | None = None, priority: int = 0) -> list[Classification]:
        ids = await off_loop(chars(texts), tokenize, self.loaded.tokenizer, texts, self.loaded.max_input_tokens,
                             truncate)
        return await self._submit([EncodeItem(x, "classify") for x in ids], adapter, timeout_s, priority)

    async def embed(self, texts: Sequence[str], truncate: bool, timeout_s: float | None,
                    adapter: AdapterRef | None = None, priority: int = 0) -> Embeddings:
        ids = await off_loop(chars(texts), tokenize, self.loaded.tokenizer, texts, self.loaded.max_input_tokens,
                             truncate)
        vectors = await self._submit([EncodeItem(x, "embed") for x in ids], adapter, timeout_s, priority)
        return Embeddings(vectors, sum(len(x) for x in ids))

    async def rerank(self, query: str, texts: Sequence[str], truncate: bool, raw_scores: bool,
                     timeout_s: float | None, adapter: AdapterRef | None = None, priority: int = 0) -> list[float]:
        """One relevance score per text, in input order: the head's score of the (query, text) pair's
        logit (a cross-encoder's: its sigmoid), or the logit itself with raw_scores."""
        pairs = await off_loop(chars(texts) + len(texts) * len(query), tokenize_pairs, self.loaded.tokenizer, query,
                               texts, self.loaded.max_input_tokens, truncate)
        return await self._submit([EncodeItem(p.ids, "rerank", p.types, raw_scores) for p in pairs], adapter,
                                  timeout_s, priority)

    @torch.inference_mode()
    def run_batch(self, payloads: list[EncodeItem]) -> list[Classification | list[float] | float]:
        model = self.loaded.model
        batch = PaddedBatch.from_token_lists([p.ids for p in payloads], self.pad_id, self.loaded.device)  # (B, T)
        types = batch.pad([p.types for p in payloads]) if self.use_types and any(p.types for p in payloads) else None
        slots = None  # (B,) each row's adapter slot, where any row has one
        if any(p.slot >= 0 for p in payloads):
            slots = torch.tensor([p.slot for p in payloads], dtype=torch.long, device=self.loaded.device)
        hidden = self.loaded.executor.hidden(batch.ids, batch.keep, types, slots)  # (B, T, C): on the plan's backend
        out: list[Any] = [None] * len(payloads)
        rows = [i for i, p in enumerate(payloads) if p.task == "embed"]
        if rows:
            for row, vector in zip(rows, model.pool(hidden[rows], batch.keep[rows]).float().cpu().tolist(), strict=True):
                out[row] = vector
        # rows labelled by one head together: the model's, or a classification adapter's own (per slot)
        heads: dict[int, list[int]] = {}
        for i, p in enumerate(payloads):
            if p.task != "embed":
                heads.setdefault(p.slot if self.adapters.head(p.slot) is not None else -1, []).append(i)
        for slot, rows in heads.items():
            head = self.adapters.head(slot)
            weights = None if head is None else head.weights
            logits = model.logits(hidden[rows], batch.keep[rows], weights).float()  # (b, n_labels)
            scores = model.scores(logits, weights).cpu().tolist()
            labels = self.loaded.labels if head is None else head.labels
            for row, p, z in zip(rows, scores, logits[:, 0].cpu().tolist(), strict=True):
                if payloads[row].task == "rerank":
                    out[row] = z if payloads[row].raw else p[0]  # the relevance logit or its score
                    continue
                best = max(range(len(p)), key=p.__getitem__)
                out[row] = Classification(labels[best], p[best], dict(zip(labels, p, strict=True)))
        return out

    def warm_up(self) -> None:
        tok = self.loaded.tokenizer
        texts = ["warm up", "a slightly longer sentence to warm up the encoder"]
        ids = tokenize(tok, texts, self.loaded.max_input_tokens, truncate=True)
        self.run_batch([EncodeItem(ids[0], "classify" if self.loaded.labels else "embed"), EncodeItem(ids[1], "embed")])
