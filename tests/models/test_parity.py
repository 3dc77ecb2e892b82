"""Logits parity with `transformers`: tiny random HF models, imported into ours, on padded batches.

Dimension legend: B batch rows (3, of different lengths), T padded length, V vocabulary, C width.
Every HF parameter is perturbed away from its init (LayerNorm weights 1, biases 0) so a wrongly
mapped norm or bias cannot hide. Outputs are compared on real tokens only.
"""

from __future__ import annotations

import pytest
import torch
import transformers as hf
from torch import Tensor
from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

from models.checkpoints import bert, gpt2, llama, marian
from models.config import Seq2SeqConfig
from models.positions import sinusoidal_table
from models.seq2seq import Seq2Seq

VOCAB, PAD = 100, 0
LENGTHS = (7, 4, 2)  # three rows of different lengths, T = 7


def assert_close_rel(ours: Tensor, ref: Tensor, tol: float = 1e-4) -> None:
    """max|ours - ref| / max|ref| <= tol."""
    assert ours.shape == ref.shape, f"shapes differ: {tuple(ours.shape)} vs {tuple(ref.shape)}"
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err <= tol, f"relative error {err:.3e} > {tol:.0e}"


@torch.no_grad()
def perturb(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """Add noise to every floating parameter (tied ones once) except names containing a `skip` part."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and not any(s in name for s in skip):
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def batch(side: str, seed: int = 1) -> tuple[Tensor, Tensor]:
    """ids (B, T) with PAD at padding and keep (B, T) bool; padding on the `side` ('right' or 'left')."""
    g = torch.Generator().manual_seed(seed)
    t = max(LENGTHS)
    slots = torch.arange(t)[None, :]  # (1, T)
    lengths = torch.tensor(LENGTHS)[:, None]  # (B, 1)
    keep = slots < lengths if side == "right" else slots >= t - lengths  # (B, T)
    ids = torch.randint(3, VOCAB, (len(LENGTHS), t), generator=g).masked_fill(~keep, PAD)  # (B, T)
    return ids, keep


def hf_positions(keep: Tensor) -> Tensor:
    """position_ids = cumsum(mask) - 1, clamped at 0: (B, T)."""
    return (keep.long().cumsum(-1) - 1).clamp(min=0)


# --- encoders -------------------------------------------------------------------------------------


@pytest.mark.parametrize("types", ["zeros", "mixed"])
def test_bert_hidden_states_match(types: str) -> None:
    torch.manual_seed(0)
    config = hf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=32, type_vocab_size=2,
                           pad_token_id=PAD, attn_implementation="eager")
    ref_model = perturb(hf.BertModel(config))
    ours = bert.from_hf(config.to_dict(), ref_model.state_dict())
    ids, keep = batch("right")
    token_types = torch.zeros_like(ids)
    if types == "mixed":
        token_types[:, 2:] = 1
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=keep.long(), token_type_ids=token_types).last_hidden_state
        got = ours(ids, keep, token_types)  # (B, T, C)
    assert_close_rel(got[keep], ref[keep])


# --- decoders -------------------------------------------------------------------------------------


def _decoder_parity(ref_model: torch.nn.Module, ours: torch.nn.Module, side: str) -> None:
    ids, keep = batch(side)
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=keep.long(), position_ids=hf_positions(keep)).logits
        got = ours(ids, keep)  # (B, T, V)
    assert_close_rel(got[keep], ref[keep])


@pytest.mark.parametrize("side", ["right", "left"])
def test_gpt2_logits_match(side: str) -> None:
    torch.manual_seed(0)
    config = hf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                           bos_token_id=1, eos_token_id=1, attn_implementation="eager")
    ref_model = perturb(hf.GPT2LMHeadModel(config))
    ours = gpt2.from_hf(config.to_dict(), ref_model.state_dict())
    assert ours.lm_head is None  # tied head
    _decoder_parity(ref_model, ours, side)


LLAMA_VARIANTS = {
    "untied": dict(tie_word_embeddings=False),
    "tied-biases": dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("variant", sorted(LLAMA_VARIANTS))
def test_llama_logits_match(variant: str, side: str) -> None:
    torch.manual_seed(0)
    config = hf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                            rope_theta=500.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=[2, 3],
                            attn_implementation="eager", **LLAMA_VARIANTS[variant])
    ref_model = perturb(hf.LlamaForCausalLM(config))
    ours = llama.from_hf(config.to_dict(), ref_model.state_dict())
    assert ours.cfg.kv_heads == 2 and ours.cfg.eos_token_ids == (2, 3) and ours.cfg.rope_theta == 500.0
    assert (ours.lm_head is None) == config.tie_word_embeddings
    _decoder_parity(ref_model, ours, side)


# --- encoder-decoder ------------------------------------------------------------------------------


def marian_config(**changes) -> hf.MarianConfig:
    fields = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                  activation_function="swish", scale_embedding=True, pad_token_id=PAD, eos_token_id=1,
                  decoder_start_token_id=PAD, attn_implementation="eager")
    return hf.MarianConfig(**{**fields, **changes})


def teacher_forced_logits(ref_model: torch.nn.Module, ours: Seq2Seq) -> tuple[Tensor, Tensor]:
    """Teacher-forced logits on real target tokens of a right-padded src + tgt batch: (N, V) each
    (any HF encoder-decoder: Marian, T5)."""
    src, src_keep = batch("right", seed=1)
    tgt, tgt_keep = batch("right", seed=2)
    tgt, tgt_keep = tgt[:, :5], tgt_keep[:, :5]  # a target length different from the source's
    with torch.no_grad():
        ref = ref_model(input_ids=src, attention_mask=src_keep.long(), decoder_input_ids=tgt,
                        decoder_attention_mask=tgt_keep.long()).logits
        got = ours(src, src_keep, tgt, tgt_keep)  # (B, T, V)
    return got[tgt_keep], ref[tgt_keep]


def test_sinusoidal_table_matches_marian() -> None:
    for dim in (32, 33):  # odd widths put the extra column in the sine half
        ref = MarianSinusoidalPositionalEmbedding(40, dim).create_weight()
        assert torch.allclose(sinusoidal_table(40, dim), ref, atol=1e-6)


def testteacher_forced_logits_match() -> None:
    torch.manual_seed(0)
    config = marian_config()
    ref_model = perturb(hf.MarianMTModel(config), skip=("embed_positions",))
    with torch.no_grad():
        ref_model.final_logits_bias.normal_()  # a buffer, not a parameter
    ours = marian.from_hf(config.to_dict(), ref_model.state_dict())
    assert ours.cfg.n_layers == 2 and ours.cfg.n_decoder_layers == 3 and ours.cfg.activation == "silu"
    assert_close_rel(*teacher_forced_logits(ref_model, ours))


def test_our_seq2seq_exports_to_marian() -> None:
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=64, n_layers=2, decoder_layers=1,
                        max_positions=32, pad_token_id=PAD, decoder_start_token_id=PAD, eos_token_id=1,
                        scale_embeddings=True, activation="gelu")
    ours = perturb(Seq2Seq(cfg))
    config, state = marian.to_hf_marian(ours)
    ref_model = hf.MarianMTModel(hf.MarianConfig(**config, attn_implementation="eager")).eval()
    ref_model.load_state_dict(state, strict=True)
    assert_close_rel(*teacher_forced_logits(ref_model, ours))
    back = marian.from_hf(config, ref_model.state_dict())  # and the round trip through Marian's names
    got, ref = teacher_forced_logits(ref_model, back)
    assert_close_rel(got, ref)
