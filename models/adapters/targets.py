"""Where a PEFT adapter's modules sit in our models: Hugging Face module names -> our projections.

An adapter names the modules of the `transformers` model it was trained on (`model.layers.3.self_attn.q_proj`,
`transformer.h.0.attn.c_attn`, `bert.encoder.layer.1.attention.self.query`). Each family's table maps a
module to one or more of our block projections (`Target`): GPT-2's fused `c_attn` is our q, k and v,
each a third of its outputs. What no table names is refused by the reader with the module's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """One of our projections: block `layer`'s `name` (q_proj, k_proj, v_proj, o_proj, gate, up, down),
    fed by outputs [start, stop) of the adapter module's B, in thirds `of` a fused module (1: all)."""

    layer: int
    name: str
    part: int = 0
    of: int = 1

    @property
    def path(self) -> str:
        """Our module's qualified name in an unfused model (EncoderModel and DecoderLM share `stack.blocks`)."""
        where = "self_attn" if self.name.endswith("_proj") else "ff"
        return f"stack.blocks.{self.layer}.{where}.{self.name}"


_LLAMA = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "o_proj",
          "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_BERT = {"attention.self.query": "q_proj", "attention.self.key": "k_proj", "attention.self.value": "v_proj",
         "attention.output.dense": "o_proj", "intermediate.dense": "up", "output.dense": "down"}
_DISTILBERT = {"attention.q_lin": "q_proj", "attention.k_lin": "k_proj", "attention.v_lin": "v_proj",
               "attention.out_lin": "o_proj", "ffn.lin1": "up", "ffn.lin2": "down"}
_GPT2 = {"attn.c_proj": "o_proj", "mlp.c_fc": "up", "mlp.c_proj": "down"}

# (pattern over the module name without peft's `base_model.model.`, its table); group 1 the layer,
# group 2 the module within it
_FAMILIES: tuple[tuple[re.Pattern[str], dict[str, str]], ...] = (
    (re.compile(r"(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"), _LLAMA),
    (re.compile(r"(?:(?:bert|roberta)\.)?encoder\.layer\.(\d+)\.(.+)"), _BERT),
    (re.compile(r"(?:distilbert\.)?transformer\.layer\.(\d+)\.(.+)"), _DISTILBERT),
    (re.compile(r"(?:transformer\.)?h\.(\d+)\.(.+)"), {**_GPT2, "attn.c_attn": ""}),
)


def targets(module: str) -> list[Target] | None:
    """Our projections fed by the adapter module `module`, None when no family's table has it."""
    for pattern, table in _FAMILIES:
        m = pattern.fullmatch(module)
        if m is None or m.group(2) not in table:
            continue
        layer, name = int(m.group(1)), m.group(2)
        if name == "attn.c_attn":  # GPT-2: q, k and v in one Conv1D
            return [Target(layer, proj, i, 3) for i, proj in enumerate(("q_proj", "k_proj", "v_proj"))]
        return [Target(layer, table[name])]
    return None
