"""The model catalog: where a model's weights come from and how `load_model` makes it serve.

A `ModelSpec` (models/spec.py, torch-free) names its sources as URIs, looked up in LOADERS by scheme:
    zoo:NAME      pinned default weights (`python -m models.zoo fetch`)
    builtin:NAME  weights committed under models/weights/NAME
    dir:PATH      our format (config.json + model.safetensors)
    hf:PATH       a Hugging Face directory (models/checkpoints/registry.py's architectures)
    gguf:PATH     a llama / qwen2 / qwen3 GGUF file (converted once, then cached)
    tiny:FAMILY   a tiny random model with a character tokenizer (tests only)
`load_model` puts the model on its device and dtype, fuses, quantizes, packs and compiles its layers,
and plans its execution last (models/execution/planner.py): its LoadedModel carries the executor.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from . import zoo
from .adapters import ResidentAdapters, read_adapter
from .architectures import BUILTIN_DIR
from .checkpoints.format import load_checkpoint, load_state_strict
from .execution.compiled import compile_blocks, uncompile_blocks, warm_up
from .execution.executors import Executor
from .execution.plan import ExecutionPlan
from .execution.planner import Runtime, log_plan, plan_model
from .kernels import native
from .projections.calibration import calibration_run
from .projections.dense import pack_dense
from .projections.fuse import fuse_projections
from .projections.panels import BLOCK_FORMATS, Bf16PanelLinear, BlockLinear, set_activation_bits
from .projections.prompt_weights import KERNELS, PROBE_TOKENS, fastest, prompt_speedup, twins_for
from .projections.quant import keeps_fusion, quantize
from .spec import DEFAULT_SPECS, ModelSpec
from .text import TextTokenizer

log = logging.getLogger("models.catalog")
__all__ = ["DEFAULT_SPECS", "LOADERS", "LoadedModel", "ModelSpec", "load_model", "resolve_dir"]



@dataclass
class LoadedModel:
    """A model ready to serve: eval mode, on its device, with its tokenizer."""

    spec: ModelSpec
    model: nn.Module
    tokenizer: TextTokenizer
    labels: tuple[str, ...] = ()
    max_input_tokens: int = 512
    load_seconds: float = 0.0
    kernels: dict[str, str] = field(default_factory=dict)  # float projections per weight shape (models/projections/dense.py)
    compile_seconds: float = 0.0  # of load_seconds, compiling and warming up the blocks (spec.compile)
    quantize: str | None = None  # the quantization in effect (spec.quantize, unless it could not run here)
    # spec.prompt_weights: the same model on float32 or bfloat16 weights, for prompts (None: `model` does all)
    prompt_model: nn.Module | None = None
    prompt_speedup: float | None = None  # prompt_weights "auto": the twin's speed / the blocks', as measured at load
    executor: Executor | None = None  # how it runs: its execution plan and the backends it chose
    draft: LoadedModel | None = None  # a generator's draft model for speculative decoding (its engine asks for one)
    prompt_weights: str | None = None  # prompt_model's weights: "float32" or "bfloat16" (None: no twin)
    serving_dtype: torch.dtype | None = None  # the dtype load_model was asked for (None: the parameters')
    adapters: ResidentAdapters | None = None  # its LoRA adapter slots (spec.adapters, adapter_dir), if any

    @property
    def plan(self) -> ExecutionPlan:
        return self.executor.plan

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it serves in: the one asked for (bfloat16 on our CPU panels keeps float32 parameters
        around them), else its parameters'."""
        return self.serving_dtype or next(self.model.parameters()).dtype

    @property
    def compiled(self) -> bool:
        """Whether its blocks run compiled (spec.compile, unless compiling failed here)."""
        return self.compile_seconds > 0

    @property
    def block_activation_bits(self) -> int | None:
        """The block formats' activation width in effect (spec.block_activation_bits); None otherwise."""
        return self.spec.block_activation_bits if self.quantize in BLOCK_FORMATS else None


def _split(uri: str) -> tuple[str, str]:
    scheme, sep, rest = uri.partition(":")
    if not sep or scheme not in LOADERS:
        raise ValueError(f"model source {uri!r} must start with one of {sorted(s + ':' for s in LOADERS)}")
    return scheme, rest


def resolve_dir(uri: str, cache_dir: Path) -> Path:
    """Directory of a zoo:/builtin:/dir:/hf: source."""
    scheme, rest = _split(uri)
    if scheme == "zoo":
        return zoo.resolve(rest, cache_dir)
    if scheme == "builtin":
        path = BUILTIN_DIR / rest
        if not path.is_dir():
            raise FileNotFoundError(f"no built-in weights {rest!r} under {BUILTIN_DIR}")
        return path
    return Path(rest).expanduser()


def _load_hf_dir(path: Path) -> tuple[nn.Module, TextTokenizer]:
    from .checkpoints.registry import import_hf_dir

    return import_hf_dir(path), TextTokenizer.from_hf_dir(path)


def _load_ours(path: Path) -> tuple[nn.Module, TextTokenizer]:
    """Our format; the tokenizer beside it, with chat_template.jinja when the directory has one."""
    return load_checkpoint(path), TextTokenizer.from_hf_dir(path)


def _load_gguf(rest: str, cache_dir: Path) -> tuple[nn.Module, TextTokenizer]:
    """gguf:PATH, or gguf:zoo:NAME for a pinned GGUF (its hash is known, so no re-hashing)."""
    from .checkpoints.cache import load_gguf_cached

    if rest.startswith("zoo:"):
        name = rest[len("zoo:"):]
        (file, digest), = zoo.ZOO[name].files.items()
        loaded = load_gguf_cached(zoo.resolve(name, cache_dir) / file, cache_dir, source_sha256=digest)
    else:
        loaded = load_gguf_cached(Path(rest).expanduser(), cache_dir)
    hf_tok = loaded.tokenizer
    special = {k: v for k, v in (("bos_token", hf_tok.bos_token), ("eos_token", hf_tok.eos_token)) if v}
    return loaded.model, TextTokenizer(hf_tok.backend_tokenizer, loaded.chat_template, special)


def _load_tiny(rest: str, cache_dir: Path) -> tuple[nn.Module, TextTokenizer]:
    from .tiny import tiny_model

    return tiny_model(rest)


LOADERS: dict[str, Callable[[str, Path], tuple[nn.Module, TextTokenizer]]] = {
    "zoo": lambda rest, cache_dir: _load_hf_dir(zoo.resolve(rest, cache_dir)),
    "builtin": lambda rest, cache_dir: _load_ours(resolve_dir("builtin:" + rest, cache_dir)),
    "dir": lambda rest, cache_dir: _load_ours(Path(rest).expanduser()),
    "hf": lambda rest, cache_dir: _load_hf_dir(Path(rest).expanduser()),
    "gguf": _load_gguf,
    "tiny": _load_tiny,
}


def _attach_head(model: nn.Module, head_uri: str, cache_dir: Path) -> tuple[nn.Module, tuple[str, ...]]:
    """Encoder + a classification head checkpoint (head.safetensors + head.json with its labels and,
    optionally, how logits become scores)."""
    from safetensors.torch import load_file

    from .encoder import EncoderModel

    head_dir = resolve_dir(head_uri, cache_dir)
    meta = json.loads((head_dir / "head.json").read_text())
    labels = tuple(meta["labels"])
    # "scores": "softmax" | "sigmoid"; left out: sigmoid for one output (a relevance score, as Hugging
    # Face scores one-label heads, so it can serve rerank), softmax over several labels
    scores = meta.get("scores", "sigmoid" if len(labels) == 1 else "softmax")
    cfg = model.cfg.replace(labels=labels, head_scores=scores)
    with_head = EncoderModel(cfg)
    state = {k: v for k, v in model.state_dict().items()}
    state.update({f"head.{k}": v for k, v in load_file(head_dir / "head.safetensors").items()})
    load_state_strict(with_head, state)
    return with_head.eval(), labels


def _compiles(spec: ModelSpec) -> bool:
    """Whether the blocks are compiled at load: compile: true, or a phase asks for the compiled backend."""
    return spec.compile or "compiled" in spec.requested_backends().values()


def _compile(spec: ModelSpec, model: nn.Module, kv_dtype: torch.dtype | None) -> tuple[float, str | None]:
    """Compile its blocks if the spec says so, warmed up on KV caches of `kv_dtype` (the engine's; None:
    the model's dtype), after its projections are packed (the compiled blocks do not re-check their
    layers): (seconds spent compiling and warming up, why compiling failed)."""
    if not _compiles(spec):
        return 0.0, None
    compile_blocks(model)
    try:
        return warm_up(model, kv_dtype), None
    except Exception as e:  # noqa: BLE001 - no C++ compiler for inductor, an unsupported op: the plan says so
        uncompile_blocks(model)
        log.warning("%s: compiling its blocks failed: %s", spec.name, str(e)[:300])
        return 0.0, str(e).splitlines()[0][:200] if str(e) else type(e).__name__


@dataclass
class _PromptTwin:
    """The copy of a generator's model its prompts run on (ModelSpec.prompt_weights), if any."""

    model: nn.Module | None = None
    weights: str | None = None  # "float32" or "bfloat16"
    speedups: dict[str, float] = field(default_factory=dict)  # "auto": each twin's speed over the blocks'
    kernels: dict[str, str] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """The fastest twin's speedup, kept or not (None unless measured)."""
        return max(self.speedups.values(), default=None)


def _prompt_twin(spec: ModelSpec, blocks: nn.Module, base: nn.Module | None, twins: tuple[str, ...],
                 cast: torch.dtype | None, mode: str | None) -> _PromptTwin:
    """Each twin of `twins` built from `base` (the float32 model before quantizing) on its panels; under
    "auto" each is timed against the `blocks`, both before any is compiled (so only the one kept is
    compiled), and the fastest kept if faster, else the one named. Our panels' rows do not depend on the
    other rows, so a prompt's keys are the same in any batch. KernelUnavailable: bfloat16 named on a CPU
    without it."""
    built: dict[str, tuple[nn.Module, dict[str, str]]] = {}
    for kind in twins:
        twin = copy.deepcopy(base) if kind != twins[-1] else base  # the last takes base itself
        if spec.fuse and keeps_fusion(None, twin):
            twin = fuse_projections(twin)
        if cast is not None:
            twin = twin.to(cast)
        built[kind] = twin, pack_dense(twin, KERNELS[kind])
        if kind == "bfloat16" and hasattr(twin, "stack"):  # its projections round their inputs to
            twin.stack.bf16_products = True  # bfloat16: so may its prompts' attention (models/kernels/)
    if not built:
        return _PromptTwin()
    if spec.prompt_weights != "auto":  # a named twin is kept unmeasured
        twin, kernels = built[twins[0]]
        return _PromptTwin(twin, twins[0], {}, kernels)
    speedups = {kind: prompt_speedup(blocks, twin) for kind, (twin, _) in built.items()}
    chosen = fastest(speedups)
    log.info("%s: a %d-token prompt ran %s as fast as on the %s blocks: prompts on %s", spec.name, PROBE_TOKENS,
             ", ".join(f"{x:.2f}x on {kind} weights" for kind, x in speedups.items()), mode,
             f"{chosen} weights" if chosen else "the blocks")
    if chosen is None:
        return _PromptTwin(speedups=speedups)
    twin, kernels = built[chosen]
    return _PromptTwin(twin, chosen, speedups, kernels)


def load_model(spec: ModelSpec, cache_dir: Path, device: str = "cpu", dtype: torch.dtype | None = None,
               runtime: Runtime = Runtime()) -> LoadedModel:
    """Load, move to device once, cast, eval, then choose its execution plan (spec.execution, for the
    `runtime` its engine gives it). Raises zoo.WeightsMissingError naming the fetch command, and
    PlanError where a backend the spec names cannot run."""
    import time

    started = time.perf_counter()
    scheme, rest = _split(spec.source)
    model, tokenizer = LOADERS[scheme](rest, cache_dir)
    labels: tuple[str, ...] = tuple(getattr(model.cfg, "labels", ()))
    if spec.head is not None:
        model, labels = _attach_head(model, spec.head, cache_dir)
    if spec.tokenizer is not None:
        tokenizer = TextTokenizer.from_file(resolve_dir(spec.tokenizer, cache_dir))
    mode = spec.quantize
    dense_kernel, serving = spec.dense_kernel, dtype
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and native.has_bf16():
        # bfloat16 on a CPU with its dot products: the projections on our bfloat16 panels, the model
        # around them (norms, residuals, attention, the KV cache) in float32 (block formats keep their blocks)
        dtype, dense_kernel = None, "bf16"
    # block formats are made from the float32 weights (a GGUF's own values): the model is quantized
    # first and cast to the serving dtype after (the blocks compute in float32 on a CPU)
    cast_after = mode in BLOCK_FORMATS
    model = model.to(device=device, dtype=dtype).eval() if dtype and not cast_after else model.to(device).eval()
    if mode in BLOCK_FORMATS and torch.device(device).type == "cpu" and not native.available():
        # a machine without AVX2 or g++: the float32 weights (for a GGUF of these blocks, the same values)
        log.warning("%s: quantize %s needs this project's CPU kernels, which are not available here (see the "
                    "log above); serving its float32 weights instead", spec.name, mode)
        mode = None
    # prompt_weights: the float32 weights the blocks are made from (for a GGUF, the file's own values)
    twins = twins_for(spec.prompt_weights, native.has_bf16()) if mode in BLOCK_FORMATS else ()
    base = copy.deepcopy(model) if twins else None
    if spec.fuse and keeps_fusion(mode, model):
        model = fuse_projections(model)
    if mode is not None:  # after the cast (the scales stay float32), calibrated on sample text
        model = quantize(model, mode, calibration_run(model, tokenizer))
        set_activation_bits(model, spec.block_activation_bits)
    if cast_after and dtype:
        model = model.to(dtype)
    kernels = pack_dense(model, dense_kernel)  # float32 CPU layers only
    prompts = _prompt_twin(spec, model, base, twins, dtype if cast_after else None, mode)
    compile_seconds, compile_error = _compile(spec, model, runtime.kv_dtype)
    if prompts.model is not None:
        twin_seconds, _ = _compile(spec, prompts.model, runtime.kv_dtype)
        compile_seconds, kernels = compile_seconds + twin_seconds, {**prompts.kernels, **kernels}
    longest = getattr(model.cfg, "max_tokens", model.cfg.max_positions)  # encoders: positions past an offset
    limit = min(spec.max_input_tokens or longest, longest)
    detail = ""
    if prompts.speedups or prompts.model is not None:
        detail = f"prompt_weights: {spec.prompt_weights}"
        if prompts.speedups:
            detail += f" -> {prompts.weights or mode + ' blocks'}"
            detail += "".join(f", {kind} {x:.2f}x the blocks" for kind, x in prompts.speedups.items())
    adapters = _adapters(spec, model, prompts.model)
    executor = plan_model(model, spec.requested_backends(), replace(runtime, compile_error=compile_error),
                          prompts.model, detail)
    log_plan(spec.name, executor.plan)
    return LoadedModel(spec, model, tokenizer, labels, limit, time.perf_counter() - started, kernels,
                       compile_seconds, mode, prompts.model, prompts.speedup, executor, prompt_weights=prompts.weights,
                       serving_dtype=serving, adapters=adapters)


def _adapters(spec: ModelSpec, model: nn.Module, twin: nn.Module | None) -> ResidentAdapters | None:
    """The model's adapter slots (and its prompt twin's, sharing them), with the configured adapters
    loaded while slots last (the rest load on first use); None where the spec serves no adapters."""
    slots = spec.adapter_slots()
    if not slots:
        return None
    # the factors in the precision of the weights beside them: float32 beside float32 weights (PEFT's
    # results to float32 rounding), int8 with per-rank scales beside 8- and 4-bit blocks on our kernel (a
    # quarter of the bytes a step reads), bfloat16 otherwise (bench-adapters in docs/benchmarks.md)
    blocks = any(isinstance(m, BlockLinear) for m in model.modules())
    exact = all(p.dtype == torch.float32 for p in model.parameters()) and not blocks and not any(
        isinstance(m, Bf16PanelLinear) for m in model.modules())
    device = next(model.parameters()).device
    kernel = device.type == "cpu" and native.available()
    factors = torch.float32 if exact else torch.int8 if blocks and kernel else torch.bfloat16
    resident = ResidentAdapters([model] + ([twin] if twin is not None else []), slots, spec.max_lora_rank,
                                factors, kernel=kernel)
    for name, path in list(spec.adapters.items())[:slots]:
        resident.load(read_adapter(path, name))
    return resident
