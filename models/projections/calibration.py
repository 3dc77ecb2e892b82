"""Sample inputs for quantization (models/projections/quant.py): each family's model run in float on the
sentences of models/data/calibration.txt, so the activation ranges of every Linear can be recorded.

The sentences are plain English of many kinds (requests, reviews, news, instructions), written for
this purpose and disjoint from every evaluation set in the repository. The encoder sees them as a
padded batch, the decoder as running text and as a chat turn, the encoder-decoder translates them
greedily (so its decoder sees its own outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..beam_search import BeamParams, translate_ids
from ..decoder import DecoderLM
from ..encoder import EncoderModel
from ..inputs import PaddedBatch
from ..seq2seq import Seq2Seq
from ..text import TextTokenizer

CALIBRATION_TEXT = Path(__file__).parents[1] / "data" / "calibration.txt"
MAX_TOKENS = 512


def sentences(path: Path = CALIBRATION_TEXT) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def calibration_run(model: nn.Module, tokenizer: TextTokenizer) -> Callable[[nn.Module], object]:
    """A function that runs `model` (in float) on the calibration sentences."""
    texts = sentences()
    device = next(model.parameters()).device

    if isinstance(model, EncoderModel):
        def run_encoder(m: nn.Module) -> object:
            pad = m.cfg.pad_token_id if m.cfg.pad_token_id is not None else 0
            batch = PaddedBatch.from_token_lists(tokenizer.encode_batch(texts), pad, device)
            return m.classify(batch.ids, batch.keep) if m.head is not None else m.embed(batch.ids, batch.keep)
        return run_encoder

    if isinstance(model, DecoderLM):
        def run_decoder(m: nn.Module) -> object:
            ids = tokenizer.encode(" ".join(texts), add_special_tokens=False)[:MAX_TOKENS]
            m(torch.tensor([ids], device=device))
            if tokenizer.chat_template:
                chat = tokenizer.apply_chat_template([{"role": "user", "content": texts[0]}])
                m(torch.tensor([tokenizer.encode(chat, add_special_tokens=False)[:MAX_TOKENS]], device=device))
            return None
        return run_decoder

    if isinstance(model, Seq2Seq):
        def run_seq2seq(m: nn.Module) -> object:
            return translate_ids(m, tokenizer.encode_batch(texts), BeamParams(beam_size=1, max_new_tokens=64))
        return run_seq2seq

    raise ValueError(f"no calibration inputs for a {type(model).__name__}")
