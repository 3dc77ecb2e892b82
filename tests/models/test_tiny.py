"""The tiny models the service tests run on: their outputs must depend on their inputs and parameters,
or a test of routing, batching or per-request parameters could not fail."""

from __future__ import annotations

import torch

from models.beam_search import BeamParams, translate_ids
from models.decoding import SamplingParams
from models.generate import generate
from models.inputs import PaddedBatch
from models.tiny import tiny_model

TEXTS = ["hello", "hello world", "xyz", "hola", "a much longer sentence here"]


def test_tiny_seq2seq_translations_depend_on_the_source_and_the_beam_size() -> None:
    model, tok = tiny_model("seq2seq")
    by_beam = {b: translate_ids(model, [tok.encode(t) for t in TEXTS], BeamParams(b, 8), banned_ids=[0])
               for b in (1, 2, 4)}
    assert len({tuple(ids) for ids in by_beam[1]}) == len(TEXTS)  # every source its own greedy output
    assert len({tuple(ids) for ids in tok.decode_batch(by_beam[1])}) >= 4  # also as text
    assert any(by_beam[1][i] != by_beam[4][i] for i in range(len(TEXTS)))  # the beam size changes some


def test_tiny_decoder_and_encoder_outputs_depend_on_the_input() -> None:
    decoder, tok = tiny_model("decoder")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = [generate(decoder, [tok.encode(t)], params)[0].tokens for t in TEXTS]
    assert len({tuple(o) for o in outs}) >= 4
    encoder, etok = tiny_model("encoder")
    batch = PaddedBatch.from_token_lists([etok.encode(t) for t in TEXTS], 0)
    with torch.inference_mode():
        hidden = encoder(batch.ids, batch.keep)  # (B, T, C)
    first = hidden[:, 0]  # (B, C)
    assert torch.cdist(first, first).fill_diagonal_(1.0).min() > 1e-3  # no two texts the same
