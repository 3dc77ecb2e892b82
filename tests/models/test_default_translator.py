"""The committed en->es translator loads and still translates about as well as when it was trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import sacrebleu
import torch

from models.catalog import DEFAULT_SPECS, load_model
from models.train.eval_translator import read_test, translate_all

# Just under the chrF measured on these 20 held-out sentences with beam 4 when the model was committed
# (see docs/models.md); a broken importer, tokenizer or beam search falls far below it.
CHRF_FLOOR = 78.0  # measured 81.5 at commit (step 5036; 70.9 at step 2096)


@pytest.fixture(scope="module")
def translator():
    return load_model(DEFAULT_SPECS["translator"], Path("/nonexistent-cache"))  # builtin: needs no cache


def test_checkpoint_is_small_and_equals_transformers_marian(translator) -> None:
    """Exported to MarianMTModel, transformers' beam search gives our translations token for token."""
    from transformers import MarianConfig, MarianMTModel

    from models.beam_search import BeamParams, translate_ids
    from models.checkpoints.marian import to_hf_marian

    weights = Path(__file__).parents[2] / "models/weights/translator-en-es/model.safetensors"
    assert weights.stat().st_size <= 40 * 2**20
    model, tok = translator.model, translator.tokenizer
    config, state = to_hf_marian(model)
    hf = MarianMTModel(MarianConfig(**config)).eval()
    hf.load_state_dict(state, strict=True)
    sources = ["Where is the station?", "She smiled and said nothing at all.", "I love this song!"]
    ids = tok.encode_batch(sources)
    pad, eos = model.cfg.pad_token_id, model.cfg.eos_token_id
    width = max(map(len, ids))
    src = torch.tensor([s + [pad] * (width - len(s)) for s in ids])  # (B, S) right-padded
    with torch.inference_mode():
        ours = translate_ids(model, ids, BeamParams(beam_size=4, max_new_tokens=48), banned_ids=[pad])
        theirs = hf.generate(input_ids=src, attention_mask=(src != pad).long(), num_beams=4, max_new_tokens=48,
                             early_stopping=False, length_penalty=1.0, bad_words_ids=[[pad]],
                             forced_eos_token_id=eos, decoder_start_token_id=pad, pad_token_id=pad,
                             eos_token_id=eos, do_sample=False)
    expected = [[t for t in row.tolist()[1:] if t not in (pad, eos)] for row in theirs]
    assert ours == expected


def test_beam4_chrf_on_held_out_sentences(translator) -> None:
    sources, refs = read_test(Path(__file__).parents[2] / "models/weights/translator-en-es/test.tsv")
    sources, refs = sources[:20], refs[:20]
    with torch.inference_mode():
        hyps = translate_all(translator.model, translator.tokenizer, sources, beam=4)
    chrf = sacrebleu.corpus_chrf(hyps, [refs]).score
    assert chrf >= CHRF_FLOOR, (chrf, list(zip(sources, hyps, strict=True))[:3])
