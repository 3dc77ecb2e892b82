"""Frozen, validated configs: one per model family, sharing the block options.

Every architectural choice the three families need is a field here, so an importer
only has to fill a config and rename tensors. Configs round-trip through JSON
(`to_dict` / `from_dict`) for our checkpoint format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

Position = Literal["sinusoidal", "learned", "rotary", "relative", "none"]
Norm = Literal["layernorm", "rmsnorm"]
Activation = Literal["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_tanh"]
RopeType = Literal["linear", "dynamic", "yarn", "llama3", "frequencies"]

_POSITIONS = ("sinusoidal", "learned", "rotary", "relative", "none")
_NORMS = ("layernorm", "rmsnorm")
_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_tanh")
_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "frequencies")


class ConfigError(ValueError):
    """A config that cannot describe a working model; the message names the field."""


def _is_int(value: Any) -> bool:
    """A real integer: bool is an int subclass, but True is no size."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequencies stretched for longer contexts, as `transformers` defines each type
    (modeling_rope_utils): linear (positions / factor), dynamic NTK (the base grows with the row's
    length past original_max_positions), YaRN (per-frequency ramp between interpolation and
    extrapolation, cos/sin scaled by an attention factor), llama3 (Llama 3.1's low/high-frequency
    smoothing); and frequencies: each inverse frequency divided by its own factor, as llama.cpp stores
    Llama 3.1's scaling in a GGUF (the `rope_freqs` tensor)."""

    type: RopeType
    factor: float
    original_max_positions: int | None = None  # dynamic, yarn, llama3: the pre-training context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None = derived from factor (and mscale)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    freq_factors: tuple[float, ...] = ()  # frequencies: one divisor per rotary frequency (D/2 of them)

    def __post_init__(self) -> None:
        if self.type not in _ROPE_TYPES:
            raise ConfigError(f"RopeScaling: type must be one of {_ROPE_TYPES}, got {self.type!r}")
        if not (_is_number(self.factor) and self.factor > 0):
            raise ConfigError(f"RopeScaling: factor must be a positive number, got {self.factor!r}")
        if self.type == "frequencies" and not (isinstance(self.freq_factors, tuple) and self.freq_factors
                                               and all(_is_number(f) and f > 0 for f in self.freq_factors)):
            raise ConfigError(f"RopeScaling: type 'frequencies' needs a tuple of positive freq_factors, "
                              f"got {self.freq_factors!r}")
        if self.type not in ("linear", "frequencies") and not (_is_int(self.original_max_positions)
                                                               and self.original_max_positions > 0):
            raise ConfigError(f"RopeScaling: type {self.type!r} needs original_max_positions, "
                              f"got {self.original_max_positions!r}")
        if self.type == "llama3" and not (_is_number(self.low_freq_factor) and _is_number(self.high_freq_factor)
                                          and self.high_freq_factor > self.low_freq_factor):
            raise ConfigError(f"RopeScaling: llama3 needs high_freq_factor > low_freq_factor, got "
                              f"high_freq_factor={self.high_freq_factor!r}, low_freq_factor={self.low_freq_factor!r}")


@dataclass(frozen=True)
class BlockConfig:
    """Options shared by every transformer stack."""

    vocab_size: int = 1000
    d_model: int = 64  # C: model width
    n_heads: int = 4  # H: query heads
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads (plain multi-head)
    d_ff: int = 256  # hidden width of the feed-forward block
    n_layers: int = 2
    max_positions: int = 512  # longest sequence the position scheme (and the cache) supports
    position: Position = "learned"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # rotary only; None = plain RoPE
    relative_buckets: int = 32  # position "relative" (T5): buckets of the learned relative bias
    relative_max_distance: int = 128  # position "relative": distances past this share the last bucket
    d_head: int | None = None  # D when it is not d_model // n_heads (Qwen3, T5's d_kv)
    qk_norm: bool = False  # an RMSNorm over each head's queries and keys before rotary (Qwen3)
    scale_attention: bool = True  # False: scores are q.k without 1/sqrt(D) (T5)
    sliding_window: int | None = None  # causal stacks: a query sees only its last W keys (Mistral)
    norm: Norm = "layernorm"
    norm_eps: float = 1e-5
    prenorm: bool = True  # False = post-norm (original Transformer, BERT, Marian)
    final_norm: bool = True  # a norm after the last block (pre-norm stacks need one)
    embed_norm: bool = False  # a norm right after the embeddings (BERT)
    activation: Activation = "gelu"
    attn_bias: bool = True  # bias on q/k/v/o projections
    attn_out_bias: bool | None = None  # bias on the output projection; None = attn_bias (Qwen2: False)
    mlp_bias: bool = True
    norm_bias: bool = True  # LayerNorm with a bias (ignored for RMSNorm)
    dropout: float = 0.0
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model)
    tie_embeddings: bool = True  # output projection shares the token embedding matrix
    pad_token_id: int | None = None

    family: ClassVar[str] = "block"

    def __post_init__(self) -> None:
        self._validate()

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:  # D
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    @property
    def out_bias(self) -> bool:
        return self.attn_bias if self.attn_out_bias is None else self.attn_out_bias

    def _validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{type(self).__name__}: {msg}")

        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "max_positions"):
            need(_is_int(getattr(self, name)) and getattr(self, name) > 0,
                 f"{name} must be a positive integer, got {getattr(self, name)!r}")
        need(self.d_head is None or (_is_int(self.d_head) and self.d_head > 0),
             f"d_head must be a positive integer or None, got {self.d_head!r}")
        need(self.d_head is not None or self.d_model % self.n_heads == 0,
             f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}), or d_head given")
        need(self.kv_heads > 0 and self.n_heads % self.kv_heads == 0,
             f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")
        need(self.position in _POSITIONS, f"position must be one of {_POSITIONS}, got {self.position!r}")
        need(self.position != "rotary" or self.head_dim % 2 == 0,
             f"rotary positions need an even head dim, got {self.head_dim}")
        need(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
             f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r} "
             "(from_dict builds one from a dict)")
        need(self.rope_scaling is None or self.position == "rotary",
             f"rope_scaling needs rotary positions, got position {self.position!r}")
        need(self.rope_scaling is None or self.rope_scaling.type != "frequencies"
             or len(self.rope_scaling.freq_factors) == self.head_dim // 2,
             f"rope_scaling.freq_factors needs one factor per rotary frequency ({self.head_dim // 2}), "
             f"got {len(self.rope_scaling.freq_factors) if self.rope_scaling else 0}")
        # dynamic NTK grows the base by a power D / (D - 2)
        need(self.rope_scaling is None or self.rope_scaling.type != "dynamic" or self.head_dim > 2,
             f"rope_scaling.type 'dynamic' needs head_dim > 2, got {self.head_dim}")
        need(self.sliding_window is None or (_is_int(self.sliding_window) and self.sliding_window > 0),
             f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.position == "relative":
            # relative_bucket: the encoder's half of the buckets splits again into exact and logarithmic
            # ones (so >= 4), and the logarithmic ones reach from the exact ones to max_distance
            need(_is_int(self.relative_buckets) and self.relative_buckets >= 4,
                 f"relative_buckets must be an integer >= 4, got {self.relative_buckets!r}")
            need(_is_int(self.relative_max_distance) and self.relative_max_distance > self.relative_buckets // 2,
                 f"relative_max_distance must be an integer > relative_buckets // 2 "
                 f"({self.relative_buckets} // 2 = {self.relative_buckets // 2}), got {self.relative_max_distance!r}")
        need(self.norm in _NORMS, f"norm must be one of {_NORMS}, got {self.norm!r}")
        need(self.activation in _ACTIVATIONS,
             f"activation must be one of {_ACTIVATIONS}, got {self.activation!r}")
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        need(self.norm_eps > 0, f"norm_eps must be positive, got {self.norm_eps}")
        need(self.pad_token_id is None or 0 <= self.pad_token_id < self.vocab_size,
             f"pad_token_id {self.pad_token_id} is outside the vocabulary (size {self.vocab_size})")

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlockConfig:
        """The config `to_dict` gave (also after a JSON round trip), as its family's class."""
        data = dict(data)
        family = data.pop("family", cls.family)
        target = CONFIGS.get(family)
        if target is None:
            raise ConfigError(f"unknown model family {family!r}; known: {sorted(CONFIGS)}")
        return _from_json(target, data, target.__name__)

    def replace(self, **changes: Any) -> BlockConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class EncoderConfig(BlockConfig):
    """BERT-style encoder with pooling and an optional classification head.

    The head is `head` (C -> labels) on `head_pooling`'s input, optionally after a C -> C dense
    layer with `head_dense`'s activation. Our sentiment head reads the sentence embedding; Hugging
    Face's sequence-classification heads read the first token: BERT through its pooler (dense +
    tanh), RoBERTa through classifier.dense + tanh, DistilBERT through pre_classifier + ReLU.
    """

    type_vocab_size: int = 0  # BERT token-type embeddings; 0 = none
    pooling: Literal["mean", "cls"] = "mean"
    normalize_embeddings: bool = True  # L2-normalise pooled embeddings (sentence-transformers)
    labels: tuple[str, ...] = ()  # classification head labels, in logit order; empty = no head
    head_pooling: Literal["embedding", "cls"] = "embedding"  # the head's input: the embedding, or the first token
    head_dense: Literal["tanh", "relu"] | None = None  # a C -> C layer + this activation before the head
    head_scores: Literal["softmax", "sigmoid"] = "softmax"  # logits -> scores (sigmoid: multi-label, 1 label)
    position_offset: int = 0  # the first token's position index (RoBERTa: padding_idx + 1)
    position: Position = "learned"
    prenorm: bool = False
    final_norm: bool = False
    embed_norm: bool = True
    activation: Activation = "gelu"
    norm_eps: float = 1e-12

    family: ClassVar[str] = "encoder"

    @property
    def max_tokens(self) -> int:
        """The longest input: the positions left after the offset."""
        return self.max_positions - self.position_offset

    def _validate(self) -> None:
        super()._validate()
        choices = {"pooling": ("mean", "cls"), "head_pooling": ("embedding", "cls"),
                   "head_dense": (None, "tanh", "relu"), "head_scores": ("softmax", "sigmoid")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"EncoderConfig: {name} must be {' or '.join(map(repr, allowed))}, "
                                  f"got {getattr(self, name)!r}")
        if self.position == "rotary":
            raise ConfigError("EncoderConfig: rotary positions are only supported in decoders")
        if self.sliding_window is not None:  # the encoder stack has no window: it would be ignored
            raise ConfigError(f"EncoderConfig: sliding_window is only supported in decoders, "
                              f"got {self.sliding_window!r}")
        if len(set(self.labels)) != len(self.labels):
            raise ConfigError(f"EncoderConfig: duplicate labels in {self.labels}")
        if not (isinstance(self.position_offset, int) and 0 <= self.position_offset < self.max_positions):
            raise ConfigError(f"EncoderConfig: position_offset must be in [0, max_positions={self.max_positions}), "
                              f"got {self.position_offset!r}")


@dataclass(frozen=True)
class DecoderConfig(BlockConfig):
    """Decoder-only causal language model (GPT-2 / Llama style)."""

    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    family: ClassVar[str] = "decoder"


@dataclass(frozen=True)
class Seq2SeqConfig(BlockConfig):
    """Encoder-decoder (Marian / original Transformer, T5). n_layers is the encoder depth.

    T5 is position "relative" (a bucketed bias per stack, no position embeddings), pre-norm RMSNorm
    with a final norm per stack, unscaled scores, no biases and no final_logits_bias; v1.0 ties its
    head and scales the decoder output by d_model**-0.5 before it (scale_head), v1.1 unties it.
    """

    decoder_layers: int | None = None  # None = n_layers
    decoder_start_token_id: int = 0
    eos_token_id: int = 0
    final_logits_bias: bool = True  # Marian keeps a (vocab,) bias on the output logits
    scale_head: bool = False  # the decoder output times d_model**-0.5 before the head (T5 v1.0)
    # (source, target, prefix): the task prefix the model expects before a text to translate source ->
    # target (T5's task_specific_params, e.g. ("en", "de", "translate English to German: "))
    translation_prefixes: tuple[tuple[str, str, str], ...] = ()
    position: Position = "sinusoidal"
    prenorm: bool = False
    final_norm: bool = False
    activation: Activation = "relu"

    family: ClassVar[str] = "seq2seq"

    @property
    def n_decoder_layers(self) -> int:
        return self.decoder_layers if self.decoder_layers is not None else self.n_layers

    def translation_prefix(self, source: str, target: str) -> str | None:
        """The task prefix for translating source -> target; None when the model has none for the pair."""
        return next((p for s, t, p in self.translation_prefixes if (s, t) == (source, target)), None)

    def _validate(self) -> None:
        super()._validate()
        if self.position == "rotary":
            raise ConfigError("Seq2SeqConfig: rotary positions are not supported for cross-attention models")
        if self.sliding_window is not None:  # the encoder stack would ignore it; no seq2seq checkpoint has one
            raise ConfigError(f"Seq2SeqConfig: sliding_window is only supported in decoders, "
                              f"got {self.sliding_window!r}")
        prefixes = self.translation_prefixes
        if not isinstance(prefixes, tuple) or not all(
                isinstance(p, tuple) and len(p) == 3 and all(isinstance(x, str) for x in p) for p in prefixes):
            raise ConfigError("Seq2SeqConfig: translation_prefixes must be (source, target, prefix) string "
                              f"triples, got {prefixes!r}")
        pairs = [(s, t) for s, t, _ in prefixes]
        if len(set(pairs)) != len(pairs):
            raise ConfigError(f"Seq2SeqConfig: translation_prefixes names a language pair twice: {pairs}")
        for name in ("decoder_start_token_id", "eos_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ConfigError(f"Seq2SeqConfig: {name} {value} is outside the vocabulary ({self.vocab_size})")


# fields whose to_dict form is a nested config's dict
_NESTED: dict[str, type] = {"rope_scaling": RopeScaling}


def _from_json(kind: type, data: dict[str, Any], owner: str, prefix: str = "") -> Any:
    """Dataclass `kind` from its to_dict form: JSON lists become tuples again at any depth (labels, eos
    ids, translation_prefixes' triples, freq_factors), a nested config's dict becomes its dataclass.
    Unknown and missing fields raise naming them, a nested one as e.g. `rope_scaling.type`."""
    fields = dataclasses.fields(kind)
    unknown = sorted(set(data) - {f.name for f in fields})
    if unknown:
        raise ConfigError(f"{owner}: unknown fields {[prefix + name for name in unknown]}")
    missing = [f.name for f in fields if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{owner}: missing fields {[prefix + name for name in missing]}")
    return kind(**{name: _from_json(_NESTED[name], value, owner, f"{prefix}{name}.")
                   if name in _NESTED and isinstance(value, dict) else _tuples(value)
                   for name, value in data.items()})


def _tuples(value: Any) -> Any:
    """Lists to tuples, also inside tuples (configs hold tuples so they stay frozen and hashable)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


CONFIGS: dict[str, type[BlockConfig]] = {
    "encoder": EncoderConfig,
    "decoder": DecoderConfig,
    "seq2seq": Seq2SeqConfig,
}

# Named presets: tiny ones for tests, the shapes of the default models for reference.
PRESETS: dict[str, BlockConfig] = {
    "tiny-encoder": EncoderConfig(vocab_size=100, d_model=16, n_heads=2, d_ff=32, n_layers=2,
                                  max_positions=64, type_vocab_size=2, pad_token_id=0),
    "tiny-gpt": DecoderConfig(vocab_size=100, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_positions=64,
                              activation="gelu_tanh", eos_token_ids=(1,)),
    "tiny-llama": DecoderConfig(vocab_size=100, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, n_layers=2,
                                max_positions=64, position="rotary", norm="rmsnorm", activation="swiglu",
                                attn_bias=False, mlp_bias=False, eos_token_ids=(1,)),
    "tiny-seq2seq": Seq2SeqConfig(vocab_size=100, d_model=16, n_heads=2, d_ff=32, n_layers=2,
                                  max_positions=64, pad_token_id=2, decoder_start_token_id=2, eos_token_id=0,
                                  scale_embeddings=True),
    # T5 v1.1's shape: relative positions, RMSNorm pre-norm, gated tanh-GELU, untied head, D * H != C
    "tiny-t5": Seq2SeqConfig(vocab_size=100, d_model=16, n_heads=2, d_head=12, d_ff=32, n_layers=2,
                             max_positions=64, position="relative", relative_buckets=8, relative_max_distance=6,
                             norm="rmsnorm", norm_eps=1e-6, prenorm=True, final_norm=True, activation="geglu_tanh",
                             attn_bias=False, mlp_bias=False, scale_attention=False, final_logits_bias=False,
                             tie_embeddings=False, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1),
}

__all__ = [
    "BlockConfig", "ConfigError", "RopeScaling", "DecoderConfig", "EncoderConfig", "Seq2SeqConfig", "CONFIGS", "PRESETS",
]
