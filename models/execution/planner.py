"""Choosing a model's execution plan, once, when it is loaded: `plan_model` returns its executor.

For each phase the candidates are tried in one order of preference, native, cuda_graphs, compiled,
torch (the first that runs wins under "auto"); a backend asked for by name must run or the load fails
with PlanError naming the phase, the backend and what it needs. Every backend not taken keeps its
reason in the plan. What is measured at load (the float projections' kernel per shape, the weights
prompts run on) was settled before planning (models/projections/dense.py, prompt_weights.py) and
appears here as detail. Call after the model's layers are final (quantized, fused, packed, compiled).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..adapters.lora import LoraLinear
from ..cache.paged import (
    KERNEL_POOL_DTYPES,
    PROMPT_HEAD_DIMS,
    kernel_runs,
    pool_kernel_runs,
    prompt_kernel_runs,
)
from ..kernels import native
from ..projections.panels import Bf16PanelLinear, BlockLinear
from .compiled import is_compiled
from .executors import DecoderExecutor, EncoderExecutor, Executor, Seq2SeqExecutor
from .native import Head, NativeDecoder, NativeEncoder, Unsupported, head_args
from .plan import BACKENDS, ExecutionPlan, PhasePlan, PlanError

log = logging.getLogger("models.execution")

PREFERENCE = ("native", "cuda_graphs", "compiled", "torch")  # "auto" takes the first that runs


@dataclass(frozen=True)
class Runtime:
    """What the code around the model gives it, which some backends depend on."""

    paged: bool = True  # decode steps on a paged KV cache (a generation engine's `paged`)
    graphs: bool | None = None  # decode steps as captured graphs: None where they run (CUDA), False never,
    # True also on a CPU, where the same padded steps run eagerly (tests)
    compile_error: str | None = None  # compiling the blocks was asked for and failed (catalog.load_model)
    kv_dtype: torch.dtype | None = None  # what the engine's KV cache keeps (None: the model's dtype)


def _kind(model: nn.Module) -> tuple[str, bool]:
    """The kind of model by its config, and whether it is our own class of that kind (the native
    backend reads our classes' modules; a stand-in with the same forward gets the torch backend)."""
    from ..config import DecoderConfig, EncoderConfig, Seq2SeqConfig
    from ..decoder import DecoderLM
    from ..encoder import EncoderModel
    from ..seq2seq import Seq2Seq

    for config, cls, kind in ((EncoderConfig, EncoderModel, "encoder"), (DecoderConfig, DecoderLM, "generator"),
                              (Seq2SeqConfig, Seq2Seq, "translator")):
        if isinstance(getattr(model, "cfg", None), config):
            return kind, isinstance(model, cls)
    raise TypeError(f"no execution plan for a {type(model).__name__}: its cfg is no model config")


def _weights(model: nn.Module) -> str:
    """What a model's projections are, for a plan's detail: "q4_1 blocks", "bfloat16 panels", "float32", ...,
    and the adapter slots beside them."""
    return _formats(model) + _adapters(model)


def _formats(model: nn.Module) -> str:
    formats = sorted({m.fmt for m in model.modules() if isinstance(m, BlockLinear)})
    if formats:
        return f"{'/'.join(formats)} blocks"
    if any(isinstance(m, Bf16PanelLinear) for m in model.modules()):
        return "bfloat16 panels"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _adapters(model: nn.Module) -> str:
    """The adapter slots beside a model's projections, for a plan's detail ("" without)."""
    lora = next((m for m in model.modules() if isinstance(m, LoraLinear)), None)
    if lora is None:
        return ""
    how = str(lora.a.dtype).removeprefix("torch.") + (", our kernel" if lora.kernel else "")
    return f", LoRA adapters: {lora.capacity} slots of rank <= {lora.rank} ({how})"


class _Phase:
    """Collects one phase's candidates: each backend's reason not to run it, or a builder."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reasons: dict[str, str] = {}
        self.builders: dict[str, Callable[[], object]] = {}
        self.details: dict[str, str] = {}

    def cannot(self, backend: str, reason: str) -> None:
        self.reasons[backend] = reason

    def can(self, backend: str, build: Callable[[], object] = lambda: None, detail: str = "") -> None:
        self.builders[backend], self.details[backend] = build, detail

    def native(self, build: Callable[[], object], detail: Callable[[object], str], ours: bool = True) -> None:
        """The native candidate: built now, to learn whether it runs (its reason if not)."""
        if not ours:
            self.cannot("native", "needs one of our model classes (a stand-in's forward runs as it is)")
            return
        try:
            built = build()
        except Unsupported as e:
            self.cannot("native", f"needs {e}")
            return
        self.can("native", lambda: built, detail(built))

    def choose(self, asked: str) -> tuple[PhasePlan, object]:
        if asked != "auto":
            if asked not in self.builders:
                raise PlanError(f"{self.name} on {asked}: {self.reasons.get(asked, 'not a backend of this phase')}")
            chosen = asked
        else:
            chosen = next(b for b in PREFERENCE if b in self.builders)
        rank = PREFERENCE.index(chosen)
        not_taken = {b: self.reasons.get(b) or (f"{chosen} is preferred" if PREFERENCE.index(b) > rank else "not asked")
                     for b in BACKENDS if b != chosen}
        return PhasePlan(self.name, chosen, self.details.get(chosen, ""), not_taken), self.builders[chosen]()


def _model_forward(phase: _Phase, model: nn.Module, runtime: Runtime, detail: str) -> None:
    """The compiled and torch candidates: the model's own blocks, compiled or eager (in place: one or
    the other for every phase that runs them)."""
    if is_compiled(model):
        phase.can("compiled", detail=detail)
        phase.cannot("torch", "eager blocks; they are compiled for this model (compile: true)")
    else:
        phase.cannot("compiled", f"compiling failed here: {runtime.compile_error}" if runtime.compile_error
                     else "needs compile: true (the blocks through torch.compile at load)")
        phase.can("torch", detail=detail)


def _isa() -> str:
    return native.isa() or "?"


def _encode(model: nn.Module, runtime: Runtime, ours: bool) -> _Phase:
    phase = _Phase("encode")
    stack = model.encoder if hasattr(model, "encoder") else getattr(model, "stack", None)  # Seq2Seq, EncoderModel
    phase.native(lambda: NativeEncoder.build(stack), lambda _: f"{_isa()}, {_weights(model)}", ours)
    phase.cannot("cuda_graphs", "decode steps only")
    _model_forward(phase, model, runtime, _weights(model))
    return phase


def _kv(model: nn.Module, runtime: Runtime) -> torch.dtype:
    """The dtype of the KV cache the model's decode steps run on."""
    return runtime.kv_dtype or next(model.parameters()).dtype


def _kv_detail(kv: torch.dtype) -> str:
    return f"{str(kv).removeprefix('torch.')} KV"


def _attention(model: nn.Module, runtime: Runtime) -> str:
    weight = next(model.parameters())
    kv = _kv(model, runtime)
    paged = runtime.paged and model.cfg.sliding_window is None
    if paged and pool_kernel_runs(kv, weight.device):
        return f"attention: paged decode kernel, {_kv_detail(kv)}"
    return "attention: SDPA" + (" on a paged cache" if paged else "") + f", {_kv_detail(kv)}"


def _prompt_attention(model: nn.Module, runtime: Runtime) -> str:
    """How a generator's prompts attend: the paged cache's prompt kernel where it runs (a float32 model,
    a mask that is only causal: no sliding window, no relative positions), else SDPA."""
    weight, cfg = next(model.parameters()), model.cfg
    kv = _kv(model, runtime)
    if not runtime.paged:
        why = "engine.paged: false"
    elif cfg.sliding_window is not None or cfg.position == "relative":
        why = "a sliding window or relative positions"
    elif weight.dtype != torch.float32:
        why = f"{str(weight.dtype).removeprefix('torch.')} queries"
    elif not pool_kernel_runs(kv, weight.device):
        why = f"{_kv_detail(kv)} on {weight.device.type}" + (
            f"; our CPU kernels: {native.unavailable_reason()}" if native.unavailable_reason() else "")
    elif not prompt_kernel_runs(kv, weight.device, cfg.head_dim):
        why = f"head dim {cfg.head_dim}; it takes {', '.join(map(str, PROMPT_HEAD_DIMS))}"
    else:
        return "attention: paged prompt kernel" + (
            ", bfloat16 products" if getattr(getattr(model, "stack", None), "bf16_products", False) else "")
    return f"attention: SDPA (not the prompt kernel: {why})"


def _decode(model: nn.Module, runtime: Runtime, head: Callable[[], object] | None, ours: bool) -> _Phase:
    phase = _Phase("decode")
    weights = _weights(model)

    head_reason = []

    kv = _kv(model, runtime)

    def build() -> NativeDecoder:
        if not runtime.paged:
            raise Unsupported("a paged KV cache; the engine keeps rows (engine.paged: false)")
        projection = None
        if head is not None:
            try:
                projection = head()
            except Unsupported as e:  # the head runs in torch after the step
                head_reason.append(f"head after it: needs {e}")
        stack = model.decoder if head is not None else model.stack  # Seq2Seq, DecoderLM
        step = NativeDecoder.build(stack, (lambda: projection) if projection is not None else None)
        if kv not in KERNEL_POOL_DTYPES:
            raise Unsupported(f"a float32 or bfloat16 KV cache (engine.kv_cache_dtype gives {kv})")
        return step

    phase.native(build, lambda step: ", ".join([_isa(), weights, step.detail(), _kv_detail(kv), *head_reason]), ours)
    device = next(model.parameters()).device
    if head is not None:
        phase.cannot("cuda_graphs", "needs a generator's engine (beam steps are not captured)")
    elif _adapters(model):
        phase.cannot("cuda_graphs", "no adapters (the captured steps have no per-row adapter slots)")
    elif runtime.graphs is False:
        phase.cannot("cuda_graphs", "engine.decode_graphs: false")
    elif not runtime.paged or model.cfg.sliding_window is not None or model.cfg.position == "relative":
        phase.cannot("cuda_graphs", "needs a paged cache, no sliding window, no relative positions")
    elif device.type != "cuda" and runtime.graphs is not True:
        phase.cannot("cuda_graphs", f"needs a CUDA device; this model is on {device.type}")
    else:
        phase.can("cuda_graphs", detail=f"{weights}, " + ("captured per bucket of rows x key blocks"
                                                          if device.type == "cuda" else "padded buckets, eager (no CUDA)"))
    _model_forward(phase, model, runtime, f"{weights}, {_attention(model, runtime)}")
    return phase


def plan_model(model: nn.Module, execution: str | Mapping[str, str] = "auto", runtime: Runtime = Runtime(),
               prompt_model: nn.Module | None = None, prompt_detail: str = "") -> Executor:
    """The executor of `model` with its plan: `execution` "auto", a backend for every phase, or
    {phase: backend} (ModelSpec.execution); PlanError where a named backend cannot run. A generator's
    `prompt_model` computes its prompts (prompt_detail says why, for the plan)."""
    from ..spec import KIND_PHASES

    kind, ours = _kind(model)
    phases = KIND_PHASES[kind]
    asked = dict.fromkeys(phases, execution) if isinstance(execution, str) else {p: "auto" for p in phases} | dict(execution)
    unknown = set(asked) - set(phases)
    if unknown:
        raise PlanError(f"a {kind} runs {list(phases)}; execution names {sorted(unknown)}")
    chosen: dict[str, tuple[PhasePlan, object]] = {}
    if kind == "encoder":
        chosen["encode"] = _encode(model, runtime, ours).choose(asked["encode"])
    elif kind == "translator":
        chosen["encode"] = _encode(model, runtime, ours).choose(asked["encode"])
        chosen["decode"] = _decode(model, runtime, lambda: _seq2seq_head(model), ours).choose(asked["decode"])
    else:
        prefill = _Phase("prefill")
        prefill.cannot("native", "decode steps only (one token a row)")
        prefill.cannot("cuda_graphs", "decode steps only (one token a row)")
        prompts = prompt_model if prompt_model is not None else model
        _model_forward(prefill, prompts, runtime, f"{_weights(prompts)}{', ' + prompt_detail if prompt_detail else ''}"
                       f", {_prompt_attention(prompts, runtime)}")
        chosen["prefill"] = prefill.choose(asked["prefill"])
        # an engine's decode_graphs: true asks for graphs (on a CPU: the same padded steps, eager)
        wanted = "cuda_graphs" if runtime.graphs is True and asked["decode"] == "auto" else asked["decode"]
        chosen["decode"] = _decode(model, runtime, None, ours).choose(wanted)
    plan = ExecutionPlan(tuple(p for p, _ in chosen.values()))
    built = {phase: backend for phase, (_, backend) in chosen.items()}
    if kind == "encoder":
        return EncoderExecutor(model, plan, built["encode"])
    if kind == "translator":
        weight = next(model.parameters())
        return Seq2SeqExecutor(model, plan, built["encode"], built["decode"], kernel_runs(weight.dtype, weight.device))
    return DecoderExecutor(model, plan, prompt_model, built["decode"])


def _seq2seq_head(model: nn.Module) -> Head:
    """An encoder-decoder's head as the native step applies it; Unsupported where the model scales first."""
    if model.head_scale != 1.0:
        raise Unsupported("no scaling before the head (T5 v1.0 rescales its hidden states)")
    return head_args(model.lm_head, model.final_logits_bias)


def executor_for(model: nn.Module | Executor, execution: str | Mapping[str, str] = "auto") -> Executor:
    """`model`'s executor: itself when it is one, else a new plan (models used directly: tests, tools)."""
    if isinstance(model, EncoderExecutor | DecoderExecutor | Seq2SeqExecutor):
        return model
    return plan_model(model, execution, Runtime(graphs=False))


def log_plan(name: str, plan: ExecutionPlan) -> None:
    log.info("%s: execution plan %s", name, plan.summary())
    if plan.reasons():
        log.info("%s: not taken: %s", name, plan.reasons())


__all__ = ["PREFERENCE", "PlanError", "Runtime", "executor_for", "log_plan", "plan_model"]
