"""The same weights in `transformers`, our numerical reference (tests and benchmarks only).

Never used at serving time; imports transformers lazily.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def transformers_from_gguf(folder: Path, gguf_name: str) -> nn.Module:
    """transformers' own GGUF reading (config, dequantization, names, q/k un-permutation) in float32.

    `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` does the same but insists on the
    `accelerate` package, which this project does not depend on; these are the functions it uses.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(folder), gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(folder / gguf_name), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    if result.missing_keys != ["lm_head.weight"] or result.unexpected_keys:  # tied: no output.weight
        raise ValueError(f"unexpected GGUF contents: missing {result.missing_keys}, extra {result.unexpected_keys}")
    model.tie_weights()
    return model


def transformers_encoder(folder: Path) -> nn.Module:
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
