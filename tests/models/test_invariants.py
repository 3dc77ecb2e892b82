"""Model invariants for every family, in fp32 to 1e-5.

Dimension legend: B batch rows, T padded length, C model dim, V vocabulary.

Every test runs twice: with torch's own float projections and with oneDNN-packed ones
(models/projections/dense.py), the two kernels `dense_kernel: auto` chooses between at load.

A sequence's outputs do not depend on what it is batched with (padding on either side), on
cached vs full computation, on where other rows of a cached step stand, or on the embeddings of
pad tokens; eval mode is deterministic. Configs cover learned / sinusoidal / rotary / relative (T5)
positions, LayerNorm / RMSNorm, pre- / post-norm, MHA / GQA, tied / untied heads. Every parameter is
perturbed away from its init so identity norms and zero biases cannot hide a bug.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import Tensor, nn

from models.cache.dense import KVCache
from models.config import PRESETS, BlockConfig, DecoderConfig, EncoderConfig, RopeScaling, Seq2SeqConfig
from models.decoder import DecoderLM
from models.encoder import EncoderModel
from models.projections.dense import kernels_here, pack_dense
from models.seq2seq import Seq2Seq

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread is fastest


TOL = dict(atol=1e-5, rtol=1e-5)
FIRST_REAL = 3  # real tokens are drawn from [3, V); ids 0..2 are pad/bos/eos in every config here
LENGTHS = (5, 8, 3)  # row 0 sits among a longer and a shorter row

ENCODERS: dict[str, EncoderConfig] = {
    "learned-layernorm-postnorm": PRESETS["tiny-encoder"],
    "sinusoidal-rmsnorm-prenorm-gqa-cls": EncoderConfig(
        vocab_size=100, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, n_layers=2, max_positions=64,
        position="sinusoidal", norm="rmsnorm", prenorm=True, final_norm=True, embed_norm=False,
        pooling="cls", normalize_embeddings=False, pad_token_id=1),
}
DECODERS: dict[str, DecoderConfig] = {
    "gpt-learned-layernorm-prenorm": PRESETS["tiny-gpt"],
    "llama-rotary-rmsnorm-gqa": PRESETS["tiny-llama"],
    "sinusoidal-postnorm-untied": DecoderConfig(
        vocab_size=100, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_positions=64, position="sinusoidal",
        prenorm=False, final_norm=False, tie_embeddings=False, activation="relu", pad_token_id=0),
    # Qwen3-like: per-head q/k norm, a head dim that is not d_model / n_heads, biases on q/k/v only
    "qwen-qknorm-headdim-qkvbias": DecoderConfig(
        vocab_size=100, d_model=16, n_heads=4, n_kv_heads=2, d_head=8, d_ff=32, n_layers=2, max_positions=64,
        position="rotary", norm="rmsnorm", activation="swiglu", attn_bias=True, attn_out_bias=False,
        qk_norm=True, mlp_bias=False, tie_embeddings=False, pad_token_id=0),
    # Mistral-like: a sliding window shorter than the rows; YaRN-scaled rotary
    "mistral-window-yarn": DecoderConfig(
        vocab_size=100, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, n_layers=2, max_positions=64,
        position="rotary", rope_scaling=RopeScaling("yarn", 4.0, 16), sliding_window=3, norm="rmsnorm",
        activation="swiglu", attn_bias=False, mlp_bias=False, pad_token_id=0),
}
SEQ2SEQS: dict[str, Seq2SeqConfig] = {
    "marian-sinusoidal-postnorm": PRESETS["tiny-seq2seq"],
    "learned-rmsnorm-prenorm-gqa-untied": Seq2SeqConfig(
        vocab_size=100, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, n_layers=2, decoder_layers=3,
        max_positions=64, position="learned", norm="rmsnorm", prenorm=True, final_norm=True,
        tie_embeddings=False, activation="swiglu", pad_token_id=0, decoder_start_token_id=1, eos_token_id=2),
    # T5: relative position bias per stack (max distance 6: exact, logarithmic and clamped buckets occur)
    "t5-v1.1-relative-geglu-untied": PRESETS["tiny-t5"],
    "t5-v1.0-relative-relu-tied-scaled": PRESETS["tiny-t5"].replace(
        activation="relu", tie_embeddings=True, scale_head=True, d_head=None, decoder_layers=3),
}
MODELS: dict[str, type[nn.Module]] = {"encoder": EncoderModel, "decoder": DecoderLM, "seq2seq": Seq2Seq}
KERNELS = kernels_here()  # aten, and oneDNN and our panels where this machine has them
KERNEL = "aten"  # set per test by the dense_kernel fixture


@pytest.fixture(autouse=True, params=KERNELS)
def dense_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(sys.modules[__name__], "KERNEL", request.param)
    return request.param


def pad_id(cfg: BlockConfig) -> int:
    return cfg.pad_token_id if cfg.pad_token_id is not None else 0


@torch.no_grad()
def build(cfg: BlockConfig, seed: int = 0) -> nn.Module:
    """A model of cfg's family, every parameter perturbed, in eval mode."""
    torch.manual_seed(seed)
    model = MODELS[cfg.family](cfg)
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    pack_dense(model, KERNEL)
    return model.eval()


def padded(cfg: BlockConfig, lengths: tuple[int, ...], side: str, seed: int) -> tuple[Tensor, Tensor]:
    """ids (B, T) with pad at padding, keep (B, T) bool; rows padded on `side` ('right'/'left')."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    slots = torch.arange(t)[None, :]  # (1, T)
    n = torch.tensor(lengths)[:, None]  # (B, 1)
    keep = slots < n if side == "right" else slots >= t - n  # (B, T)
    ids = torch.randint(FIRST_REAL, cfg.vocab_size, (len(lengths), t), generator=g)  # (B, T)
    return ids.masked_fill(~keep, pad_id(cfg)), keep


def real(ids: Tensor, keep: Tensor, row: int) -> Tensor:
    """Row `row`'s real tokens as a (1, n) batch of its own."""
    return ids[row][keep[row]][None, :]


def close(got: Tensor, want: Tensor) -> None:
    torch.testing.assert_close(got, want, **TOL)


def not_pad(cfg: BlockConfig, logits: Tensor) -> Tensor:
    """Logits of every token but pad: with tied embeddings the pad row is also the pad token's output."""
    keep = torch.arange(cfg.vocab_size) != pad_id(cfg)  # (V,)
    return logits[..., keep]


def perturb_padding(cfg: BlockConfig, model: nn.Module, ids: Tensor, keep: Tensor) -> Tensor:
    """Other ids at padded positions, and a different pad row in the token embedding matrix."""
    g = torch.Generator().manual_seed(99)
    other = torch.randint(0, cfg.vocab_size, ids.shape, generator=g)  # (B, T)
    with torch.no_grad():
        tokens = model.get_submodule("stack.embed.tokens" if cfg.family != "seq2seq" else "encoder.embed.tokens")
        tokens.weight[pad_id(cfg)] += 5.0 * torch.randn(cfg.d_model, generator=g)
    return torch.where(keep, ids, other)


# --- padding invariance ---------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_encoder_row_alone_equals_row_in_padded_batch(name: str, side: str) -> None:
    cfg = ENCODERS[name]
    model = build(cfg)
    ids, keep = padded(cfg, LENGTHS, side, seed=1)
    with torch.no_grad():
        hidden = model(ids, keep)  # (B, T, C)
        pooled = model.embed(ids, keep) if side == "right" else None  # CLS pooling reads slot 0
        for row in range(len(LENGTHS)):
            alone = real(ids, keep, row)  # (1, n)
            close(hidden[row][keep[row]], model(alone)[0])
            if pooled is not None:
                close(pooled[row], model.embed(alone)[0])


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoder_row_alone_equals_row_in_padded_batch(name: str, side: str) -> None:
    cfg = DECODERS[name]
    model = build(cfg)
    ids, keep = padded(cfg, LENGTHS, side, seed=1)
    with torch.no_grad():
        logits = model(ids, keep)  # (B, T, V)
        assert torch.isfinite(logits).all()  # left-padded slots attend to nothing: zeros, not NaN
        for row in range(len(LENGTHS)):
            close(logits[row][keep[row]], model(real(ids, keep, row))[0])


@pytest.mark.parametrize("name", sorted(SEQ2SEQS))
def test_seq2seq_row_alone_equals_row_in_padded_batch(name: str) -> None:
    cfg = SEQ2SEQS[name]
    model = build(cfg)
    src, src_keep = padded(cfg, LENGTHS, "right", seed=1)
    tgt, tgt_keep = padded(cfg, (4, 2, 6), "right", seed=2)  # target lengths ordered unlike the sources'
    with torch.no_grad():
        logits = model(src, src_keep, tgt, tgt_keep)  # (B, T_tgt, V)
        for row in range(len(LENGTHS)):
            s, t = real(src, src_keep, row), real(tgt, tgt_keep, row)
            close(logits[row][tgt_keep[row]], model(s, torch.ones_like(s, dtype=torch.bool), t)[0])


# --- pad embeddings do not leak -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_encoder_ignores_pad_embeddings(name: str) -> None:
    cfg = ENCODERS[name]
    model = build(cfg)
    ids, keep = padded(cfg, LENGTHS, "right", seed=1)
    with torch.no_grad():
        hidden, pooled = model(ids, keep), model.embed(ids, keep)
        ids2 = perturb_padding(cfg, model, ids, keep)
        close(model(ids2, keep)[keep], hidden[keep])
        close(model.embed(ids2, keep), pooled)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoder_ignores_pad_embeddings(name: str, side: str) -> None:
    cfg = DECODERS[name]
    model = build(cfg)
    ids, keep = padded(cfg, LENGTHS, side, seed=1)
    with torch.no_grad():
        logits = model(ids, keep)
        ids2 = perturb_padding(cfg, model, ids, keep)
        close(not_pad(cfg, model(ids2, keep)[keep]), not_pad(cfg, logits[keep]))


@pytest.mark.parametrize("name", sorted(SEQ2SEQS))
def test_seq2seq_ignores_pad_embeddings(name: str) -> None:
    cfg = SEQ2SEQS[name]
    model = build(cfg)
    src, src_keep = padded(cfg, LENGTHS, "right", seed=1)
    tgt, tgt_keep = padded(cfg, (4, 2, 6), "right", seed=2)
    with torch.no_grad():
        logits = model(src, src_keep, tgt, tgt_keep)
        src2 = perturb_padding(cfg, model, src, src_keep)
        tgt2 = torch.where(tgt_keep, tgt, src2[:, : tgt.size(1)])  # other ids at target padding too
        close(not_pad(cfg, model(src2, src_keep, tgt2, tgt_keep)[tgt_keep]), not_pad(cfg, logits[tgt_keep]))


# --- cached decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [(1,) * 9, (4, 1, 1, 3)], ids=["token-by-token", "prefill-then-steps"])
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_cached_decoding_equals_full_recomputation(name: str, chunks: tuple[int, ...]) -> None:
    cfg = DECODERS[name]
    model = build(cfg)
    ids, _ = padded(cfg, (9, 9), "right", seed=3)  # (2, 9)
    cache = KVCache.for_model(cfg, rows=2, max_len=12)
    with torch.no_grad():
        full = model(ids)  # (2, 9, V)
        start = 0
        for n in chunks:
            step = model(ids[:, start:start + n], cache=cache.view())  # (2, n, V)
            close(step, full[:, start:start + n])
            cache.advance(n)
            start += n
    assert start == ids.size(1)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_cached_rows_at_different_positions_equal_their_solo_runs(name: str) -> None:
    """Right-padded prefill of prompts of different lengths, then steps where every row sits at its
    own position: each row's logits equal a full run over that row's tokens alone."""
    cfg = DECODERS[name]
    model = build(cfg)
    prompt_lengths, steps = (2, 6, 4), 4
    ids, keep = padded(cfg, prompt_lengths, "right", seed=4)
    g = torch.Generator().manual_seed(5)
    follow = torch.randint(FIRST_REAL, cfg.vocab_size, (len(prompt_lengths), steps), generator=g)  # (B, steps)
    lengths = keep.sum(-1)  # (B,)
    cache = KVCache.for_model(cfg, rows=3, max_len=max(prompt_lengths) + steps)
    with torch.no_grad():
        got = [model(ids, cache=cache.view(), last=lengths - 1)[:, 0]]  # (B, V) at each row's last token
        cache.advance(lengths)
        for i in range(steps):
            got.append(model(follow[:, i:i + 1], cache=cache.view())[:, 0])  # (B, V)
            cache.advance(1)
        got_t = torch.stack(got, dim=1)  # (B, steps + 1, V)
        for row, n in enumerate(prompt_lengths):
            alone = torch.cat([real(ids, keep, row), follow[row:row + 1]], dim=1)  # (1, n + steps)
            close(got_t[row], model(alone)[0, n - 1:])
    assert torch.equal(cache.lengths, lengths + steps)


@pytest.mark.parametrize("name", sorted(SEQ2SEQS))
def test_seq2seq_cached_decode_equals_forward(name: str) -> None:
    cfg = SEQ2SEQS[name]
    model = build(cfg)
    src, src_keep = padded(cfg, LENGTHS, "right", seed=1)
    tgt, _ = padded(cfg, (6, 6, 6), "right", seed=2)
    with torch.no_grad():
        full = model(src, src_keep, tgt)  # (B, 6, V)
        cross = model.cross_cache(model.encode(src, src_keep), src_keep)
        close(model.decode(tgt, cross), full)  # uncached decode through the CrossCache
        cache = KVCache.for_model(cfg, rows=len(LENGTHS), max_len=8)
        close(model.decode(tgt[:, :2], cross, cache=cache.view()), full[:, :2])  # a prefill chunk
        cache.advance(2)
        for t in range(2, tgt.size(1)):
            close(model.decode(tgt[:, t:t + 1], cross, cache=cache.view()), full[:, t:t + 1])
            cache.advance(1)
        # beams: rows reordered in the cache and the cross cache together still match
        index = torch.tensor([2, 0, 0])
        cache.reorder(index)
        nxt = torch.tensor([[7], [8], [9]])
        step = model.decode(nxt, cross.select(index), cache=cache.view())  # (B, 1, V)
        ref = model(src[index], src_keep[index], torch.cat([tgt[index], nxt], dim=1))[:, -1:]
        close(step, ref)


# --- eval is deterministic, dropout only in train mode ---------------------------------------------


FAMILY_CONFIGS = {"encoder": ENCODERS, "decoder": DECODERS, "seq2seq": SEQ2SEQS}


def run(model: nn.Module, cfg: BlockConfig, ids: Tensor, keep: Tensor) -> Tensor:
    if cfg.family == "seq2seq":
        return model(ids, keep, ids[:, :4])
    return model(ids, keep)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_dropout_only_in_train_mode(family: str) -> None:
    base = next(iter(FAMILY_CONFIGS[family].values()))
    cfg = base.replace(dropout=0.3)
    model = build(cfg)
    no_dropout = MODELS[family](base.replace(dropout=0.0)).eval()
    no_dropout.load_state_dict(model.state_dict())
    ids, keep = padded(cfg, LENGTHS, "right", seed=1)
    with torch.no_grad():
        torch.manual_seed(1)
        a = run(model, cfg, ids, keep)
        torch.manual_seed(2)
        b = run(model, cfg, ids, keep)
        assert torch.equal(a, b)  # eval: deterministic whatever the RNG state
        close(a, run(no_dropout, cfg, ids, keep))  # and no dropout anywhere
        model.train()
        torch.manual_seed(1)
        c = run(model, cfg, ids, keep)
        torch.manual_seed(2)
        d = run(model, cfg, ids, keep)
    assert not torch.allclose(c, d) and not torch.allclose(c, a)
