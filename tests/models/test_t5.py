"""T5 / Flan-T5 (v1.0, v1.1) and mT5 against `transformers`: tiny random HF models imported into ours.

Dimension legend: B batch rows (sources of different lengths), T padded length, S key length,
H heads, V vocabulary.

v1.0: ReLU feed-forward, the head tied to the shared embeddings, the decoder output scaled by
d_model**-0.5 before it. v1.1: gated tanh-GELU, an untied head, d_kv * heads != d_model. mT5: v1.1's
layout, never scaled. The relative bias has 8 buckets and max_distance 6, so exact, logarithmic and
clamped buckets all occur at these lengths. Every parameter is moved away from its init; for the
generation tests the weights are spread so outputs vary (each test asserts that they do).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as hf
from torch import Tensor
from transformers.models.t5.modeling_t5 import T5Attention

from models.beam_search import BeamParams, translate_ids
from models.cache.dense import KVCache
from models.checkpoints import t5
from models.checkpoints.format import CheckpointError, load_checkpoint, save_checkpoint
from models.checkpoints.registry import IMPORTERS
from models.positions import RelativePositionBias, relative_bucket
from models.seq2seq import Seq2Seq
from tests.models.test_generation_parity import right_pad as right_pad_mask
from tests.models.test_parity import assert_close_rel, perturb, teacher_forced_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread is fastest

VOCAB, PAD, EOS = 100, 0, 1
N_NEW = 20
SOURCES = [[5, 9, 13, 40, 41, EOS], [7, EOS], [20, 21, 22, 23, 24, 25, 26, 27, 28, EOS], [60, 61, 3, EOS],
           [88, 12, 12, 45, 6, 71, 33, EOS]]
# transformers' generate() with every setting that shapes the search spelled out as translate_ids does
# it: eos forced at the length limit, pad (= the start token) banned, plain length penalty,
# early_stopping=False heuristic, no n-gram or repetition rules
HF_SEARCH = dict(do_sample=False, max_new_tokens=N_NEW, early_stopping=False, length_penalty=1.0,
                 forced_eos_token_id=EOS, bad_words_ids=[[PAD]], eos_token_id=EOS, pad_token_id=PAD,
                 decoder_start_token_id=PAD, num_return_sequences=1, no_repeat_ngram_size=0,
                 repetition_penalty=1.0, min_length=0)

VARIANTS: dict[str, dict[str, Any]] = {
    "v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, d_kv=6),  # 4 * 6 != 32
    "v1.1-silu": dict(feed_forward_proj="gated-silu", tie_word_embeddings=False),
    "mt5": dict(model_type="mt5", tie_word_embeddings=False),
}


def hf_t5(variant: str, **changes: Any) -> hf.PreTrainedModel:
    """A tiny random HF T5 (or mT5) of `variant`, eval mode; an untied head really is its own matrix."""
    fields = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=6, dropout_rate=0.0,
                  pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, attn_implementation="eager")
    fields |= {k: v for k, v in VARIANTS[variant].items() if k != "model_type"} | changes
    if VARIANTS[variant].get("model_type") == "mt5":
        model = hf.MT5ForConditionalGeneration(hf.MT5Config(**fields))
    else:
        model = hf.T5ForConditionalGeneration(hf.T5Config(**fields))
    if not VARIANTS[variant]["tie_word_embeddings"]:  # transformers 5 ties it at init whatever the config says
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 0.05)
    return model.eval()


def imported(ref: torch.nn.Module) -> Seq2Seq:
    ours = t5.from_hf(ref.config.to_dict(), ref.state_dict())
    assert (ours.lm_head is None) == (ref.lm_head.weight is ref.shared.weight)
    return ours


def right_pad(seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    """ids (B, T) right-padded with PAD, keep (B, T) bool."""
    ids, mask = right_pad_mask(seqs)  # (B, T) each
    return ids, mask.bool()


def until(tokens: list[int], stop: int) -> list[int]:
    return tokens[:tokens.index(stop)] if stop in tokens else tokens


# --- the relative position bias -------------------------------------------------------------------


@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (8, 6), (16, 20)])
@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
def test_relative_bucket_equals_transformers(bidirectional: bool, buckets: int, max_distance: int) -> None:
    relative = torch.arange(-300, 301)[None, :] + torch.arange(0, 4)[:, None] * 7  # (4, 601): both directions
    ours = relative_bucket(relative, bidirectional, buckets, max_distance)
    ref = T5Attention._relative_position_bucket(relative, bidirectional=bidirectional, num_buckets=buckets,
                                                max_distance=max_distance)
    assert torch.equal(ours, ref)
    assert int(ours.min()) == 0 and int(ours.max()) == buckets - 1  # the grid reaches the clamped last bucket


@pytest.mark.parametrize("past", [0, 5])
def test_relative_bias_equals_transformers_compute_bias(past: int) -> None:
    """Queries at past .. past+T-1 (a cached step), keys at 0 .. S-1, as T5Attention.compute_bias."""
    torch.manual_seed(0)
    config = hf.T5Config(d_model=16, d_kv=4, num_heads=4, relative_attention_num_buckets=8,
                         relative_attention_max_distance=6, is_decoder=True)
    ref = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    ours = RelativePositionBias(4, 8, 6, bidirectional=False)
    with torch.no_grad():
        ours.weight.copy_(ref.relative_attention_bias.weight)
    t, s = 3, past + 3
    q_pos = (past + torch.arange(t)).expand(2, t)  # (B, T)
    got = ours(q_pos, torch.arange(s))  # (B, H, T, S)
    assert got.shape == (2, 4, t, s)
    want = ref.compute_bias(t, s, past_seen_tokens=past)  # (1, H, T, S)
    assert torch.equal(got, want.expand_as(got))


def test_relative_bias_rows_at_their_own_positions() -> None:
    """Each row's bias depends on its own positions only: a row shifted by k equals the bias of the
    shifted positions, whatever the other rows hold."""
    torch.manual_seed(0)
    bias = RelativePositionBias(2, 8, 6, bidirectional=True)
    q_pos = torch.tensor([[0, 1, 2], [4, 5, 6]])  # (B, T)
    k_pos = torch.tensor([[0, 1, 2, 3], [0, 0, 4, 5]])  # (B, S)
    got = bias(q_pos, k_pos)  # (B, H, T, S)
    for row in range(2):
        buckets = relative_bucket(k_pos[row][None, :] - q_pos[row][:, None], True, 8, 6)  # (T, S)
        assert torch.equal(got[row], bias.weight[buckets].permute(2, 0, 1))  # (H, T, S)


# --- teacher-forced logits ------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_t5_logits_match(variant: str) -> None:
    torch.manual_seed(0)
    ref = perturb(hf_t5(variant))
    ours = imported(ref)
    cfg = ours.cfg
    assert cfg.position == "relative" and cfg.n_decoder_layers == 3 and not cfg.scale_attention
    assert cfg.scale_head == (variant == "v1.0") and cfg.tie_embeddings == (variant == "v1.0")
    assert cfg.head_dim * cfg.n_heads != cfg.d_model if variant == "v1.1" else True
    assert_close_rel(*teacher_forced_logits(ref, ours))


def test_left_padded_sources_equal_right_padded() -> None:
    """Our relative positions come from the keep mask, so left padding changes nothing (transformers
    counts slots, so only right padding is compared with it)."""
    torch.manual_seed(0)
    ours = imported(perturb(hf_t5("v1.1")))
    right, right_keep = right_pad(SOURCES)
    left, left_keep = right.clone(), right_keep.clone()
    for row, n in enumerate(right_keep.sum(-1).tolist()):  # the same tokens at the end of each row
        left[row], left_keep[row] = right[row].roll(right.size(1) - n), right_keep[row].roll(right.size(1) - n)
    assert not torch.equal(left_keep, right_keep)
    tgt, _ = right_pad([[PAD, 8, 9, 10]] * len(SOURCES))
    with torch.no_grad():
        a = ours(right, right_keep, tgt)  # (B, T, V)
        b = ours(left, left_keep, tgt)  # (B, T, V)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_source_row_alone_equals_the_row_in_a_padded_batch() -> None:
    torch.manual_seed(0)
    ours = imported(perturb(hf_t5("v1.0")))
    src, src_keep = right_pad(SOURCES)
    tgt, _ = right_pad([[PAD, 8, 9, 10]] * len(SOURCES))
    with torch.no_grad():
        together = ours(src, src_keep, tgt)  # (B, T, V)
        for row, source in enumerate(SOURCES):
            alone = torch.tensor([source])  # (1, n)
            torch.testing.assert_close(together[row], ours(alone, torch.ones_like(alone, dtype=torch.bool),
                                                           tgt[row:row + 1])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["v1.0", "v1.1"])
def test_cached_decoding_equals_transformers_forward(variant: str) -> None:
    """Token by token through the KV cache and the cross-attention cache (query positions from the
    cache), against transformers' uncached teacher-forced logits."""
    torch.manual_seed(0)
    ref = perturb(hf_t5(variant))
    ours = imported(ref)
    src, src_keep = right_pad(SOURCES)
    g = torch.Generator().manual_seed(3)
    tgt = torch.cat([torch.full((len(SOURCES), 1), PAD), torch.randint(3, VOCAB, (len(SOURCES), 8), generator=g)], 1)
    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=src_keep.long(), decoder_input_ids=tgt).logits  # (B, 9, V)
        cross = ours.cross_cache(ours.encode(src, src_keep), src_keep)
        cache = KVCache.for_model(ours.cfg, rows=len(SOURCES), max_len=tgt.size(1))
        steps = []
        for i in range(tgt.size(1)):
            steps.append(ours.decode(tgt[:, i:i + 1], cross, cache=cache.view()))  # (B, 1, V)
            cache.advance(1)
    assert_close_rel(torch.cat(steps, dim=1), want)


# --- greedy and beam search -----------------------------------------------------------------------


@torch.no_grad()
def spread(model: torch.nn.Module, eos_boost: float) -> torch.nn.Module:
    """Weights that make a random T5 say varied things: matrices at unit-variance outputs (embeddings
    and head at std 1), the decoder's self-attention and feed-forward outputs 3x that (so a token's
    own embedding does not dominate a tied head), the rest perturbed; eos made likelier so that some
    hypotheses end before the limit."""
    for name, p in model.named_parameters():
        if p.dim() == 2 and "relative_attention_bias" not in name:
            boost = 3.0 if name.startswith("decoder") and name.endswith(("SelfAttention.o.weight", ".wo.weight")) else 1
            std = 1.0 if name.startswith(("shared", "lm_head")) else p.size(1) ** -0.5
            p.normal_(std=boost * std)
        else:
            p.add_(torch.randn_like(p) * 0.3)
    head = model.shared.weight if model.lm_head.weight is model.shared.weight else model.lm_head.weight
    head[EOS] += eos_boost
    return model.eval()


@pytest.fixture(scope="module", params=["v1.0", "v1.1"])
def pair(request: pytest.FixtureRequest) -> tuple[str, Seq2Seq, Callable[[int], list[list[int]]]]:
    """(variant, our model, HF translations of SOURCES by beam size, each computed once)."""
    torch.manual_seed(4)
    # as many decoder layers as encoder layers: transformers' generate() sizes its cache by num_layers
    ref = spread(hf_t5(request.param, num_decoder_layers=2), eos_boost=1.5)
    ours = imported(ref)
    ids, keep = right_pad(SOURCES)
    done: dict[int, list[list[int]]] = {}

    def theirs(beams: int) -> list[list[int]]:
        if beams not in done:
            with torch.no_grad():
                out = ref.generate(ids, attention_mask=keep.long(), num_beams=beams, **HF_SEARCH)
            done[beams] = [until(row[1:], EOS) for row in out.tolist()]  # no start token, nothing from eos
        return done[beams]

    return request.param, ours, theirs


@pytest.mark.parametrize("beams", [1, 4])
def test_search_matches_transformers_generate(pair, beams: int) -> None:
    variant, ours, theirs = pair
    mine = translate_ids(ours, SOURCES, BeamParams(beam_size=beams, max_new_tokens=N_NEW), banned_ids=(PAD,))
    assert mine == theirs(beams)
    assert len({tuple(m) for m in mine}) == len(SOURCES) and all(len(set(m)) >= 2 for m in mine), mine
    assert max(len(m) for m in mine) == N_NEW - 1  # rows run to the limit (the last step is eos)
    if variant == "v1.1" and beams == 1:
        assert min(len(m) for m in mine) < N_NEW - 1  # and some end on eos first


def test_beam_sizes_per_request_match_transformers(pair) -> None:
    """One batch with a different beam size per source equals HF run once per beam size."""
    _, ours, theirs = pair
    sizes = [4, 1, 2, 4, 1]
    mine = translate_ids(ours, SOURCES, [BeamParams(beam_size=n, max_new_tokens=N_NEW) for n in sizes],
                         banned_ids=(PAD,))
    assert mine == [theirs(n)[i] for i, n in enumerate(sizes)]
    assert theirs(1) != theirs(4)  # beam search really searches here


# --- the importer ---------------------------------------------------------------------------------


def test_t5_and_mt5_are_imported_by_model_type() -> None:
    assert IMPORTERS["t5"] is t5.from_hf and IMPORTERS["mt5"] is t5.from_hf


@pytest.mark.parametrize("fields,scaled", [
    ({}, True),  # T5 v1.0 as written before transformers 5: tie_word_embeddings defaults to true
    ({"tie_word_embeddings": False}, False),  # Flan-T5 / v1.1 config.json
    ({"tie_word_embeddings": True, "scale_decoder_outputs": False}, False),  # v1.1 saved by transformers 5
    ({"model_type": "mt5"}, False),
])
def test_head_scaling_is_read_from_the_config(fields: dict[str, Any], scaled: bool) -> None:
    base = {"model_type": "t5", "vocab_size": VOCAB, "d_model": 32, "d_kv": 8, "num_heads": 4, "d_ff": 48,
            "num_layers": 2}
    cfg = t5.config_from_hf({**base, **fields})
    assert cfg.scale_head == scaled
    assert (cfg.pad_token_id, cfg.decoder_start_token_id, cfg.eos_token_id) == (0, 0, 1)  # T5's defaults


@pytest.mark.parametrize("field,value", [
    ("feed_forward_proj", "gated-relu"),
    ("feed_forward_proj", "gelu"),
    ("is_encoder_decoder", False),
    ("dense_act_fn", "relu"),  # contradicts gated-gelu: transformers would run relu
    ("model_type", "umt5"),
    ("architectures", ["T5EncoderModel"]),
    ("architectures", ["T5ForSequenceClassification"]),
])
def test_unsupported_config_values_are_named(field: str, value: Any) -> None:
    config = {**hf_t5("v1.1").config.to_dict(), field: value}
    with pytest.raises(CheckpointError, match=field):
        t5.config_from_hf(config)


def test_task_prefixes_and_head_come_from_the_checkpoint(tmp_path: Path) -> None:
    """Prefixes from task_specific_params; an lm_head that differs from `shared` is an untied head even
    where the config (as transformers 5 writes it) says tied; the old cross-attention bias table is
    ignored as transformers does; all of it survives our checkpoint format."""
    torch.manual_seed(0)
    ref = perturb(hf_t5("v1.1"))
    config = {**ref.config.to_dict(), "tie_word_embeddings": True, "task_specific_params": {
        "summarization": {"prefix": "summarize: "},
        "translation_en_to_de": {"prefix": "translate English to German: ", "num_beams": 4},
        "translation_en_to_fr": {"prefix": "translate English to French: "}}}
    state = dict(ref.state_dict())
    state["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = torch.zeros(8, 4)
    ours = t5.from_hf(config, state)
    cfg = ours.cfg
    assert ours.lm_head is not None and not cfg.tie_embeddings
    assert cfg.translation_prefix("en", "de") == "translate English to German: "
    assert cfg.translation_prefix("en", "fr") == "translate English to French: "
    assert cfg.translation_prefix("de", "en") is None
    save_checkpoint(ours, tmp_path)
    back = load_checkpoint(tmp_path)
    assert back.cfg == cfg
    assert_close_rel(*teacher_forced_logits(ref, back))
