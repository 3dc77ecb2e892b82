"""The interface the engines, searches and replicas call to run a model: one executor per family.

An executor holds a model, its ExecutionPlan and the backend objects the plan chose (planner.py builds
all three together); each method computes one phase on its planned backend, never another. The model's
own `forward` is the torch backend and the reference every other backend is tested against
(tests/models/execution/). Executors are used by one thread at a time (an engine's or a batcher's).

    B rows, T tokens a row, C model dim, V vocabulary
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor, nn

from ..cache.cross import CrossCache
from .native import CrossRows, NativeDecoder, NativeEncoder
from .plan import ExecutionPlan, PhasePlan


def _rows(adapters: Tensor | None) -> dict[str, Tensor]:
    """The adapter argument of a forward or a backend call, only when some row has an adapter: a model
    served without adapters (or a stand-in with the same forward) is called as it always was."""
    return {} if adapters is None else {"adapters": adapters}


@dataclass
class EncoderExecutor:
    """An encoder's pass (phase encode): the blocks on the native backend or the model's own."""

    model: nn.Module  # EncoderModel
    plan: ExecutionPlan
    blocks: NativeEncoder | None = None  # the native backend's blocks, when the plan chose it

    def hidden(self, ids: Tensor, keep: Tensor | None = None, token_types: Tensor | None = None,
               adapters: Tensor | None = None) -> Tensor:
        """ids (B, T), keep (B, T), adapters (B,) each row's adapter slot (-1: none) -> hidden states (B, T, C)."""
        return self.model.stack(ids, keep, token_types, layers=self.blocks, **_rows(adapters))

    def embed(self, ids: Tensor, keep: Tensor | None = None, token_types: Tensor | None = None,
              adapters: Tensor | None = None) -> Tensor:
        """Pooled sentence embeddings (B, C), as EncoderModel.embed."""
        keep = keep if keep is not None else ids.new_ones(ids.shape, dtype=bool)  # (B, T)
        return self.model.pool(self.hidden(ids, keep, token_types, adapters), keep)

    def classify(self, ids: Tensor, keep: Tensor | None = None, token_types: Tensor | None = None,
                 adapters: Tensor | None = None) -> Tensor:
        """Label logits (B, L), as EncoderModel.classify."""
        keep = keep if keep is not None else ids.new_ones(ids.shape, dtype=bool)  # (B, T)
        return self.model.logits(self.hidden(ids, keep, token_types, adapters), keep)


@dataclass
class DecoderExecutor:
    """A decoder-only LM's prefill and decode phases. `prompt_model`: the same model on the float32
    weights prompts are computed with (ModelSpec.prompt_weights), else `model` itself."""

    model: nn.Module  # DecoderLM
    plan: ExecutionPlan
    prompt_model: nn.Module | None = None
    step: NativeDecoder | None = None  # the native backend's decode step, when the plan chose it

    def __post_init__(self) -> None:
        if self.prompt_model is None:
            self.prompt_model = self.model

    @property
    def split(self) -> bool:
        """Whether prompts and decode steps run on different weights."""
        return self.prompt_model is not self.model

    def prefill(self, ids: Tensor, cache, last: Tensor, adapters: Tensor | None = None) -> Tensor:
        """Prompts (B, T), right-padded, `last` (B,) each one's last real index -> logits (B, 1, V)
        on the prompt weights; their keys go to `cache` (a view) at each row's length. adapters (B,):
        each row's adapter slot (-1: none; None: no row has one), as in every method here."""
        return self.prompt_model(ids, cache=cache, last=last, **_rows(adapters))

    def extend(self, ids: Tensor, cache, last: Tensor, adapters: Tensor | None = None) -> Tensor:
        """prefill on the decode weights (a preempted request's output, recomputed as it was decoded)."""
        return self.model(ids, cache=cache, last=last, **_rows(adapters))

    def decode(self, ids: Tensor, cache, adapters: Tensor | None = None) -> Tensor:
        """One token a row, ids (B, 1), over `cache` (a view) -> logits (B, 1, V)."""
        if self.step is not None:
            return self.model.logits(self.step(ids, cache, **_rows(adapters)))  # (B, 1, V)
        return self.model(ids, cache=cache, **_rows(adapters))

    def graphs(self, cache) -> object | None:
        """The decode steps as captured graphs over `cache` (the engine's) when the plan chose them."""
        if self.plan.backend("decode") != "cuda_graphs":
            return None
        from .graphs import DecodeGraphs

        return DecodeGraphs(self.model, cache)

    def without_graphs(self, reason: str) -> None:
        """Graphs could not be captured at warm-up (before serving) and the plan chose them itself:
        the decode phase becomes the model's own forward, with the reason in the plan."""
        from .compiled import is_compiled

        phase, backend = self.plan["decode"], "compiled" if is_compiled(self.model) else "torch"
        not_taken = {b: why for b, why in phase.not_taken.items() if b != backend} | {"cuda_graphs": reason}
        new = PhasePlan("decode", backend, "", not_taken)
        self.plan = replace(self.plan, phases=tuple(new if p.phase == "decode" else p for p in self.plan.phases))


@dataclass
class Seq2SeqExecutor:
    """An encoder-decoder's source pass (phase encode) and its beam steps (phase decode)."""

    model: nn.Module  # Seq2Seq
    plan: ExecutionPlan
    blocks: NativeEncoder | None = None  # the native backend's source encoder, when the plan chose it
    step: NativeDecoder | None = None  # the native backend's decode step (head inside), when chosen
    native_select: bool = False  # a search picks its candidates in one native call (float32 logits, CPU kernels)

    def encode(self, src: Tensor, keep: Tensor) -> CrossCache:
        """Sources (B, S), keep (B, S) -> every decoder layer's cross keys and values."""
        return self.model.cross_cache(self.model.encoder(src, keep, layers=self.blocks), keep)

    def rows(self, cross: CrossCache) -> CrossRows | None:
        """What every decode step over this row layout of `cross` passes the native step (a search keeps
        it while its rows stay as they are); None on the other backends."""
        return self.step.cross_rows(cross) if self.step is not None else None

    def decode(self, tokens: Tensor, cross: CrossCache, cache, rows: CrossRows | None = None) -> Tensor:
        """One token a row, tokens (B, 1), over `cache` (a view) and the sources `cross` -> logits
        (B, 1, V). `rows`: self.rows(cross), when the caller keeps it."""
        if self.step is not None:
            out = self.step(tokens, cache, rows if rows is not None and rows.cross is cross else self.rows(cross))
            return out if self.step.head is not None else self.model.logits(out)  # (B, 1, V)
        return self.model.decode(tokens, cross, cache=cache)


Executor = EncoderExecutor | DecoderExecutor | Seq2SeqExecutor
