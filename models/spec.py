"""What to serve, without torch: a model's name, its tasks, its sources as URIs, its defaults.

`ModelSpec` is the one description of a served model: the catalog loads it (models/catalog.py),
the service's settings embed it as it appears in a config file (service/settings.py), and the
ingress, which never imports torch, routes by it. Source URIs are listed in catalog.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

Task = Literal["classify", "embed", "rerank", "translate", "generate"]
Kind = Literal["encoder", "translator", "generator"]
Quantization = Literal["int8", "q8_0", "q4_1"]
DenseKernel = Literal["auto", "panels", "onednn", "aten", "bf16"]  # float projections on CPU: models/projections/dense.py
PromptWeights = Literal["same", "float", "bfloat16", "auto"]  # the weights a generator computes prompts with (ModelSpec)
# execution plans (models/execution/): the phases a model runs and the backends that may compute them
Phase = Literal["encode", "prefill", "decode"]
Backend = Literal["torch", "compiled", "native", "cuda_graphs"]
PHASES: tuple[Phase, ...] = get_args(Phase)
BACKENDS: tuple[Backend, ...] = get_args(Backend)
# the kind of model (and of deployment) each task needs
TASK_KIND: dict[str, Kind] = {"classify": "encoder", "embed": "encoder", "rerank": "encoder",
                              "translate": "translator", "generate": "generator"}
# the phases each kind of model runs, in the order a request meets them
KIND_PHASES: dict[Kind, tuple[Phase, ...]] = {"encoder": ("encode",), "translator": ("encode", "decode"),
                                              "generator": ("prefill", "decode")}


@dataclass(frozen=True)
class ModelSpec:
    """What to serve. `tasks` lists the endpoints the model answers (an encoder can do two); left
    empty, they follow from the checkpoint's architecture (models/architectures.py)."""

    __pydantic_config__ = {"extra": "forbid"}  # in a config file (pydantic reads it), a misspelt field is an error

    name: str
    source: str
    tasks: tuple[Task, ...] = ()
    head: str | None = None  # classify: a head checkpoint (builtin:NAME or dir:PATH)
    tokenizer: str | None = None  # default: the tokenizer beside the weights
    languages: tuple[str, str] | None = None  # translate: (source, target)
    max_input_tokens: int | None = None  # default: the model's max_positions
    defaults: Mapping[str, Any] = field(default_factory=dict)  # decoding defaults for this model
    # "int8": 8-bit weights and per-token 8-bit activations; "q8_0" / "q4_1": GGUF's 8-bit / 4-bit
    # weight blocks with activations quantized per group of 32, on our CPU kernels (models/projections/quant.py,
    # models/projections/panels.py)
    quantize: Quantization | None = None
    # q8_0 / q4_1: activations quantized per group of 32 to 16 bits (two 8-bit parts: the float
    # model's results to ~1e-5, its greedy answers kept) or 8 (one part, llama.cpp's arithmetic:
    # up to 2x faster at 8-32 rows, the same at one row; flips the float model's close calls)
    block_activation_bits: Literal[16, 8] = 16
    # q8_0 / q4_1 generators: "float" computes prompts (prefill) with a float32 copy of the weights
    # (for a GGUF, the file's own values) and decodes with the blocks; "bfloat16" with those weights
    # rounded to bfloat16 on our bfloat16 panels (CPUs with AVX512-BF16; bfloat16's loss on the prompt);
    # "auto" measures one prompt through the blocks and each copy this CPU runs at load and keeps the
    # fastest (models/projections/prompt_weights.py). Every prompt takes the same path, and the kernels'
    # rows do not depend on each other, so tokens stay the same alone or batched.
    prompt_weights: PromptWeights = "same"
    fuse: bool = True  # q/k/v and gate/up as one projection each (models/projections/fuse.py): the same results, faster
    # float projections on CPU: "auto" measures MKL, oneDNN and our panel kernels per weight shape at
    # load and keeps the fastest; "panels" / "onednn" packs all with that kernel, "aten" none; "bf16"
    # all on our bfloat16 panels (weights and activations rounded to bfloat16, products summed in
    # float32; CPUs with AVX512-BF16, else the load fails) (models/projections/dense.py)
    dense_kernel: DenseKernel = "auto"
    # every transformer block through torch.compile (inductor), compiled and warmed up at load
    # (models/execution/compiled.py): the same results to fp32 rounding, a few times faster per token at
    # small batches on CPU; costs seconds to a minute at start-up the first time on a machine
    compile: bool = False
    # the backend of each phase (models/execution/): "auto" chooses by what the machine runs (and, for
    # the projections, by timing at load); a backend name ("torch", "compiled", "native",
    # "cuda_graphs") for every phase, or {phase: backend} for some, is required: a load fails where
    # the machine or the model cannot run it. The plan is in /v1/models and the start-up log.
    execution: str | Mapping[str, str] = "auto"
    # LoRA adapters of this model (PEFT directories; models/adapters/): name -> directory, each a model of
    # its own in /v1/models, chosen by a request's `model`; `adapter_dir`: a directory whose subdirectories
    # are adapters, found by name on first use. A replica holds `max_adapters` at once (least recently
    # used unloaded; default 8 where adapters or adapter_dir are set, else none), of rank up to max_lora_rank.
    adapters: Mapping[str, str] = field(default_factory=dict)
    adapter_dir: str | None = None
    max_adapters: int | None = None
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        problems = []
        if not self.name:
            problems.append("name must not be empty")
        if not self.tasks:
            from .architectures import infer_tasks

            inferred = infer_tasks(self.source)
            if inferred:
                object.__setattr__(self, "tasks", tuple(inferred))  # frozen: set once, while constructing
        if not self.tasks:
            problems.append(f"tasks must name at least one task (they cannot be read from {self.source!r})")
        unknown = [t for t in self.tasks if t not in TASK_KIND]
        if unknown:
            problems.append(f"unknown tasks {unknown}; known: {sorted(TASK_KIND)}")
        elif len({TASK_KIND[t] for t in self.tasks}) > 1:
            kinds = sorted({TASK_KIND[t] for t in self.tasks})
            problems.append(f"tasks {list(self.tasks)} need different kinds of deployment ({kinds}); "
                            "split them into two deployments")
        if "translate" in self.tasks and self.languages is None:
            problems.append("it translates but names no languages: [source, target]")
        if self.quantize is not None and self.quantize not in get_args(Quantization):
            problems.append(f"quantize must be one of {list(get_args(Quantization))} or null, got {self.quantize!r}")
        if self.block_activation_bits not in (16, 8):
            problems.append(f"block_activation_bits must be 16 or 8, got {self.block_activation_bits!r}")
        if self.prompt_weights not in get_args(PromptWeights):
            problems.append(f"prompt_weights must be one of {list(get_args(PromptWeights))}, got {self.prompt_weights!r}")
        elif self.prompt_weights != "same" and self.quantize not in ("q8_0", "q4_1"):
            problems.append(f"prompt_weights: {self.prompt_weights} needs quantize q8_0 or q4_1, got {self.quantize!r}")
        elif self.prompt_weights != "same" and "generate" not in self.tasks:
            problems.append(f"prompt_weights: {self.prompt_weights} is for generators (their prompts and decode "
                            "steps differ)")
        if self.dense_kernel not in get_args(DenseKernel):
            problems.append(f"dense_kernel must be one of {list(get_args(DenseKernel))}, got {self.dense_kernel!r}")
        dims = self.defaults.get("dimensions")
        if dims is not None and not (isinstance(dims, list | tuple) and dims
                                     and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)):
            problems.append(f"defaults.dimensions must list the positive embedding sizes the model may be cut "
                            f"to, got {dims!r}")
        if self.tasks and not unknown and len({TASK_KIND[t] for t in self.tasks}) == 1:
            try:
                self.requested_backends()
            except ValueError as e:
                problems.append(str(e))
        if self.adapter_slots() or self.adapters or self.adapter_dir:
            if self.tasks and TASK_KIND.get(self.tasks[0]) == "translator":
                problems.append("adapters are served on generators and encoders, not translators")
            if self.adapter_slots() < 1:
                problems.append("adapters or adapter_dir need max_adapters >= 1")
            if not 1 <= self.max_lora_rank <= 256:
                problems.append(f"max_lora_rank must be 1 to 256, got {self.max_lora_rank}")
            if self.name in self.adapters:
                problems.append(f"an adapter cannot be named as its model ({self.name!r})")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            problems.append(f"max_input_tokens must be >= 1, got {self.max_input_tokens}")
        if problems:
            raise ValueError(f"model {self.name!r}: " + "; ".join(problems))

    def adapter_slots(self) -> int:
        """Adapters a replica holds at once: max_adapters, or 8 where adapters or adapter_dir are set."""
        if self.max_adapters is not None:
            return self.max_adapters
        return 8 if self.adapters or self.adapter_dir else 0

    @property
    def kind(self) -> Kind:
        return TASK_KIND[self.tasks[0]]

    def requested_backends(self) -> dict[Phase, str]:
        """`execution` as {phase: "auto" or a backend} for every phase of this kind of model;
        ValueError naming what is unknown or not a phase of this model."""
        phases = KIND_PHASES[self.kind]
        asked = self.execution
        if isinstance(asked, str):
            if asked != "auto" and asked not in BACKENDS:
                raise ValueError(f"execution must be auto, one of {list(BACKENDS)} or {{phase: backend}}, got {asked!r}")
            return dict.fromkeys(phases, asked)
        if not isinstance(asked, Mapping):
            raise ValueError(f"execution must be a string or a mapping, got {type(asked).__name__}")
        out: dict[Phase, str] = dict.fromkeys(phases, "auto")
        for phase, backend in asked.items():
            if phase not in phases:
                raise ValueError(f"execution names phase {phase!r}; a {self.kind} runs {list(phases)}")
            if backend != "auto" and backend not in BACKENDS:
                raise ValueError(f"execution.{phase} must be auto or one of {list(BACKENDS)}, got {backend!r}")
            out[phase] = backend
        return out



def variant(spec: ModelSpec, mode: str) -> ModelSpec:
    """`spec` in a benchmark's mode: "fp32", "bf16" (float32 weights rounded onto our bfloat16 panels:
    dense_kernel bf16) or a quantization, then "+"-separated flags: "compiled" (compile: true), "a8"
    (block_activation_bits: 8), "bf16p" (a generator's prompts on bfloat16 weights: prompt_weights
    bfloat16; other models keep theirs). E.g. "q4_1+a8+compiled"."""
    precision, *flags = mode.split("+")
    unknown = set(flags) - {"compiled", "a8", "bf16p"}
    if unknown:
        raise ValueError(f"unknown flags {sorted(unknown)} in mode {mode!r}; known: compiled, a8, bf16p")
    return replace(spec, quantize=None if precision in ("fp32", "bf16") else precision, compile="compiled" in flags,
                   block_activation_bits=8 if "a8" in flags else 16,
                   dense_kernel="bf16" if precision == "bf16" else spec.dense_kernel,
                   prompt_weights="bfloat16" if "bf16p" in flags and "generate" in spec.tasks else spec.prompt_weights)


# The defaults `make serve` uses: one encoder for classification and embeddings, our translator,
# and SmolLM2 for generation.
DEFAULT_SPECS: dict[str, ModelSpec] = {
    "encoder": ModelSpec(
        name="minilm-sentiment", tasks=("classify", "embed"), source="zoo:minilm",
        head="builtin:sentiment-head", max_input_tokens=256,
    ),
    "translator": ModelSpec(
        name="transformer-en-es", tasks=("translate",), source="builtin:translator-en-es",
        languages=("en", "es"), max_input_tokens=128, defaults={"beam_size": 4, "max_new_tokens": 128},
    ),
    "generator": ModelSpec(
        name="smollm2-135m-instruct", tasks=("generate",), source="gguf:zoo:smollm2",
        max_input_tokens=2048, defaults={"max_new_tokens": 128, "temperature": 0.0},
    ),
}
