"""models/native_blocks.py: a causal stack's decode step as one native op per layer (Llama-style
decoders, post-norm LayerNorm decoders, encoder-decoders with cross-attention) equals the blocks' own
path (to float32 rounding), gives a row the same bits alone and among others, and is taken exactly
where it computes what the blocks compute.

Dimension legend: B rows, V vocabulary, C model dim.
"""

from __future__ import annotations

import pytest
import torch

from models import native_blocks
from models.beam_search import BeamParams, BeamSearch, translate_ids
from models.decoder import DecoderLM
from models.decoding import SamplingParams
from models.dense import pack_dense
from models.encoder import EncoderModel
from models.fuse import fuse_projections
from models.generate import generate
from models.paged_cache import PagedKVCache
from models.quant import quantize
from models.seq2seq import Seq2Seq
from models.tiny import SEQ2SEQ_SPREAD, tiny_model

from .test_paged_cache import PROMPTS, gqa_model, run
from .test_quant import needs_kernels

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), needs_kernels]


def fast_model(weights: str, **changes: object) -> DecoderLM:
    """SmolLM2's attention shape in small (G = 3, D = 64) (with the config `changes`), its projections
    fused, then as the shipped generator holds them (q4_1 blocks, a Q8_0 head), as 8-bit blocks, or as
    float32 panels."""
    model = gqa_model()
    if changes:
        torch.manual_seed(0)
        model = DecoderLM(model.cfg.replace(**changes)).eval()
    model = fuse_projections(model)
    if weights in ("q4_1", "q8_0"):
        return quantize(model, weights)
    pack_dense(model, "panels")
    return model


# a GPT-2-like block: post-norm LayerNorm with biases, learned positions, a plain GELU MLP, biases
POST_NORM = {"prenorm": False, "norm": "layernorm", "position": "learned", "activation": "gelu",
             "attn_bias": True, "mlp_bias": True}


def steps(model: DecoderLM, native: bool, monkeypatch: pytest.MonkeyPatch, prompts=PROMPTS) -> list[torch.Tensor]:
    """Each step's logits (B, V) of a prefill and 20 greedy decode steps on a paged cache, with the decode
    steps through decode_layer or through the blocks."""
    taken = []
    real = native_blocks.decode_layers

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        taken.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(native_blocks, "decode_layers", spy)
    if not native:
        monkeypatch.setattr(native_blocks, "runs", lambda *a: False)
    out = run(model, PagedKVCache.for_model(model.cfg, rows=len(prompts), blocks=20, max_len=64), prompts, 20)
    monkeypatch.undo()
    one_token = max(map(len, prompts)) == 1  # a prefill of one token per row is a decode step too
    assert len(taken) == ((20 + one_token) if native else 0)  # every one-token step, and only those, took the op
    return out


@pytest.mark.parametrize(("weights", "changes"), [
    ("q4_1", {}), ("f32", {}), ("f32", POST_NORM), ("q8_0", {**POST_NORM, "activation": "relu", "n_kv_heads": 6}),
    ("f32", {"activation": "gelu_tanh", "norm": "layernorm", "norm_bias": False}),
])
def test_native_blocks_equals_the_blocks(weights: str, changes: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fast_model(weights, **changes)
    assert native_blocks.stack_args(model.stack.blocks) is not None
    blocks = steps(model, False, monkeypatch)
    native = steps(model, True, monkeypatch)
    # the block formats quantize activations: fp32 rounding that differs (the glue's order) can move one
    # across a step of its 16-bit (two-part) codes, ~1e-5 of the group's largest input (test_compiled)
    atol = 1e-4 if weights != "f32" else 1e-5
    for step, (b, n) in enumerate(zip(blocks, native, strict=True)):
        torch.testing.assert_close(n, b, rtol=1e-5, atol=atol, msg=f"step {step}")
        assert torch.equal(n.argmax(-1), b.argmax(-1))


def decoded_apart(model: DecoderLM, prompts: list[list[int]], n: int) -> list[torch.Tensor]:
    """Each prompt prefilled on its own (its own row of one paged cache, the same computation whatever
    else is in the batch: a padded prefill is not what is tested here), then n greedy decode steps of
    all rows together through the op: each decode step's logits (B, V)."""
    cache = PagedKVCache.for_model(model.cfg, rows=len(prompts), blocks=20, max_len=64)
    first = []
    with torch.inference_mode():
        for row, p in enumerate(prompts):
            first.append(model(torch.tensor([p]), cache=cache.view(row, row + 1))[:, -1])  # (1, V)
            cache.advance([len(p)], row, row + 1)
        logits, out = torch.cat(first), []  # (B, V)
        for _ in range(n):
            logits = model(logits.argmax(-1)[:, None], cache=cache.view())[:, 0]  # (B, V)
            cache.advance(1)
            out.append(logits)
    return out


@pytest.mark.parametrize("weights", ["q4_1", "f32"])
def test_native_blocks_gives_a_row_the_same_bits_alone_and_among_others(weights: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 19, 4 and 2 tokens (different key counts every step): a row's decode steps through the op
    give the same bits alone and among the others."""
    model = fast_model(weights)
    prompts = [PROMPTS[0], PROMPTS[1], [50, 51]]
    taken = spied(monkeypatch, True)
    together = decoded_apart(model, prompts, 20)
    for row, prompt in enumerate(prompts):
        alone = decoded_apart(model, [prompt], 20)
        for step, (t, a) in enumerate(zip(together, alone, strict=True)):
            assert torch.equal(t[row], a[0]), f"row {row}, step {step}"
    assert taken and all(taken)


def test_generate_decodes_through_the_op_and_keeps_its_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline loop (models.generate) decodes on the paged cache the engine uses, so it takes the op,
    and gives the tokens of the blocks' path."""
    model = fast_model("q4_1")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    calls = []
    real = native_blocks.decode_layers
    monkeypatch.setattr(native_blocks, "decode_layers", lambda *a: calls.append(1) or real(*a))
    fast = [g.tokens for g in generate(model, PROMPTS, params)]
    assert len(calls) == 11
    monkeypatch.setattr(native_blocks, "runs", lambda *a: False)
    assert [g.tokens for g in generate(model, PROMPTS, params)] == fast


def test_other_blocks_keep_their_own_path() -> None:
    """A stack is taken only when decode_layer computes every block the way the block does."""
    model = fast_model("q4_1")
    assert native_blocks.stack_args(model.stack.blocks) is not None
    plain, _ = tiny_model("decoder")  # unfused nn.Linear projections
    assert native_blocks.stack_args(plain.stack.blocks) is None
    qk = fuse_projections(DecoderLM(gqa_model().cfg.replace(qk_norm=True)).eval())
    assert native_blocks.stack_args(quantize(qk, "q4_1").stack.blocks) is None
    post = fuse_projections(DecoderLM(gqa_model().cfg.replace(prenorm=False)).eval())
    assert native_blocks.stack_args(quantize(post, "q4_1").stack.blocks) is not None  # post-norm is served
    int8 = quantize(fuse_projections(gqa_model()), "int8")  # fbgemm's dynamic int8 Linear: not one of ours
    assert native_blocks.stack_args(int8.stack.blocks) is None
    model.train()
    assert native_blocks.stack_args(model.stack.blocks) is None


def test_the_arguments_follow_the_model_after_load() -> None:
    """stack_args is cached per stack, and rebuilt when what it read changes: the activation bits, a
    projection swapped, train mode."""
    from models.panels import set_activation_bits

    model = fast_model("q4_1")
    first = native_blocks.stack_args(model.stack.blocks)
    assert first is not None and native_blocks.stack_args(model.stack.blocks) is first  # cached
    assert {p for layer in first.layers for p in layer.parts} == {2}  # two 8-bit activation parts
    set_activation_bits(model, 8)
    eight = native_blocks.stack_args(model.stack.blocks)
    assert eight is not first and {p for layer in eight.layers for p in layer.parts} == {1}
    assert native_blocks.stack_args(model.stack.blocks) is eight  # nothing changed since: cached
    model.stack.blocks[0].train()
    assert native_blocks.stack_args(model.stack.blocks) is None  # the op computes eval mode only
    model.eval()
    assert native_blocks.stack_args(model.stack.blocks) is not None
    attn = model.stack.blocks[1].self_attn
    attn.qkv = torch.nn.Linear(attn.qkv.in_features, attn.qkv.out_features, bias=False)
    assert native_blocks.stack_args(model.stack.blocks) is None


def translator(weights: str = "f32") -> Seq2Seq:
    """tiny:seq2seq at the shipped translator's head shape (4 heads of D = 64, post-norm LayerNorm,
    ReLU, biases, sinusoidal positions), its weights spread as tiny_model does (outputs depend on the
    source and the beam size), fused and packed as load_model leaves it."""
    base, _ = tiny_model("seq2seq")
    torch.manual_seed(0)
    model = Seq2Seq(base.cfg.replace(d_model=256, n_heads=4, d_ff=128)).eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() >= 2:
                weight.mul_(SEQ2SEQ_SPREAD)
    model = fuse_projections(model)
    if weights != "f32":
        return quantize(model, weights)
    pack_dense(model, "panels")
    return model


SOURCES = [[5, 80, 81, 9, 70, 66, 1], [100, 7, 1], [33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 1]]


def spied(monkeypatch: pytest.MonkeyPatch, native: bool) -> list[bool]:
    """Count decode_layers calls that ran the op (not None); native False: never try it."""
    taken: list[bool] = []
    real = native_blocks.decode_layers
    monkeypatch.setattr(native_blocks, "decode_layers", lambda *a: taken.append((out := real(*a)) is not None) or out)
    if not native:
        monkeypatch.setattr(native_blocks, "runs", lambda *a: False)
    return taken


def cross_steps(model: Seq2Seq, sources: list[list[int]], n: int, rows: list[int] | None = None) -> list[torch.Tensor]:
    """Encode `sources` (right-padded), then n greedy decode steps on a paged cache for the sources at
    `rows` (all by default): each step's logits (B, V)."""
    from models.inputs import PaddedBatch

    src = PaddedBatch.from_token_lists(sources, model.cfg.pad_token_id)
    rows = list(range(len(sources))) if rows is None else rows
    cache = PagedKVCache.for_model(model.cfg, len(rows), blocks=4 * len(rows), max_len=n + 1)
    tokens = torch.full((len(rows), 1), model.cfg.decoder_start_token_id)  # (B, 1)
    out = []
    with torch.inference_mode():
        cross = model.cross_cache(model.encode(src.ids, src.keep), src.keep).select(torch.tensor(rows))
        for _ in range(n):
            logits = model.decode(tokens, cross, cache=cache.view())[:, -1]  # (B, V)
            cache.advance(1)
            out.append(logits)
            tokens = logits.argmax(-1, keepdim=True)  # (B, 1)
    return out


@pytest.mark.parametrize("weights", ["f32", "q8_0"])
def test_native_cross_attention_step_equals_the_blocks(weights: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder-decoder's decode steps (post-norm, cross-attention over right-padded sources of 3 to 13
    tokens) through the op: the blocks' logits to float32 rounding, every step taking the op."""
    model = translator(weights)
    taken = spied(monkeypatch, False)
    blocks = cross_steps(model, SOURCES, 12)
    monkeypatch.undo()
    taken = spied(monkeypatch, True)
    native = cross_steps(model, SOURCES, 12)
    assert taken == [True] * 12
    for step, (b, n) in enumerate(zip(blocks, native, strict=True)):
        # q8_0 quantizes activations (two 8-bit parts): a code moved by the glue's fp32 order shows as
        # ~5e-5 of the logits' scale (here ~2, the spread weights)
        torch.testing.assert_close(n, b, rtol=1e-5, atol=1e-5 if weights == "f32" else 3e-4, msg=f"step {step}")
        assert torch.equal(n.argmax(-1), b.argmax(-1))


EMBEDDINGS = {  # rotary (no position rows) and a final RMSNorm; learned positions; sinusoidal, scaled
    "llama q4_1": lambda: fast_model("q4_1"),
    "post-norm f32": lambda: fast_model("f32", **POST_NORM),
    "translator f32": lambda: translator(),
}


@pytest.mark.parametrize("which", list(EMBEDDINGS))
def test_the_op_embeds_and_norms_as_the_modules_do(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step's embedding inside the op (the token's row, times the scale, plus the position's
    row: learned, sinusoidal, or none with rotary) gives the bits of Embeddings.forward passed in as the
    op's input; the stack's final norm inside the op equals the module's to float32 rounding."""
    model = EMBEDDINGS[which]()
    stack = model.decoder if isinstance(model, Seq2Seq) else model.stack
    assert native_blocks.embedding_args(stack.embed) is not None

    def logits(embed: bool, norm: bool) -> list[torch.Tensor]:
        if not embed:
            monkeypatch.setattr(native_blocks, "embedding_args", lambda module: None)
        if not norm:
            monkeypatch.setattr(native_blocks, "final_norm_args", lambda module: None)
        taken = spied(monkeypatch, True)
        out = cross_steps(model, SOURCES, 8) if isinstance(model, Seq2Seq) else steps(model, True, monkeypatch)
        assert isinstance(model, DecoderLM) or taken == [True] * 8
        monkeypatch.undo()
        return out

    inside, given = logits(True, True), logits(False, True)
    for step, (a, b) in enumerate(zip(inside, given, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    if stack.norm is not None:  # the post-norm decoders have none
        apart = logits(True, False)
        for step, (a, b) in enumerate(zip(inside, apart, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_the_op_applies_the_head_as_the_model_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A translator's decode step with its head inside the op (the packed head and Marian's
    final_logits_bias, added as each logit is stored) gives the bits of the head applied after the op;
    the fused step is taken where the head is float32 panels, not where a bias would follow 8-bit blocks."""
    model = translator()
    with torch.no_grad():
        model.final_logits_bias.copy_(torch.linspace(-3, 3, model.cfg.vocab_size))  # a bias that shows
    assert native_blocks.head_args(model.lm_head, model.final_logits_bias) is not None
    calls = []
    real = model.decoder.decode_step
    monkeypatch.setattr(model.decoder, "decode_step", lambda *a: calls.append(len(a) >= 4 and a[3] is not None) or real(*a))
    inside = cross_steps(model, SOURCES, 10)
    assert calls == [True] * 10  # every step took the head inside
    monkeypatch.setattr(native_blocks, "head_args", lambda *a: None)
    after = cross_steps(model, SOURCES, 10)
    for step, (a, b) in enumerate(zip(inside, after, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    quantized = translator("q8_0")
    assert native_blocks.head_args(quantized.lm_head, quantized.final_logits_bias) is None


def test_native_cross_attention_gives_a_row_the_same_bits_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoder rows of the same encoder output (one encoder pass: its padded batch is not what is tested
    here) give the same bits alone and among others."""
    model = translator()
    taken = spied(monkeypatch, True)
    together = cross_steps(model, SOURCES, 10)
    for row in range(len(SOURCES)):
        alone = cross_steps(model, SOURCES, 10, rows=[row])
        for step, (t, a) in enumerate(zip(together, alone, strict=True)):
            assert torch.equal(t[row], a[0]), f"row {row}, step {step}"
    assert taken and all(taken)


@pytest.fixture(scope="module")
def shipped_translator():
    """The committed en->es translator with every float projection as panels (the op's layout; "auto"
    keeps the fastest kernel per shape on the machine), and the first 24 held-out sentences."""
    from dataclasses import replace
    from pathlib import Path

    from models.catalog import DEFAULT_SPECS, load_model
    from models.train.eval_translator import read_test

    loaded = load_model(replace(DEFAULT_SPECS["translator"], dense_kernel="panels"), Path("/nonexistent-cache"))
    sources, _ = read_test(Path(__file__).parents[2] / "models/weights/translator-en-es/test.tsv")
    return loaded.model, loaded.tokenizer.encode_batch(sources[:24])


@pytest.mark.parametrize("beam", [1, 4])
def test_beam_search_through_the_op_keeps_its_translations(beam: int, shipped_translator,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """translate_ids (the offline search and the engine's BeamSearch, beams grouped per source) on the
    shipped translator takes the op on every step and gives the blocks' path's tokens, together and
    each source alone."""
    from models.beam_search import BeamParams, translate_ids

    model, sources = shipped_translator
    params = BeamParams(beam, 64)
    spied(monkeypatch, False)
    expected = translate_ids(model, sources, params)
    monkeypatch.undo()
    taken = spied(monkeypatch, True)
    assert translate_ids(model, sources, params) == expected
    assert taken and all(taken)
    assert [translate_ids(model, [s], params)[0] for s in sources[:6]] == expected[:6]
    assert len({tuple(e) for e in expected}) == len(sources)  # the outputs depend on the source


def test_left_padded_sources_keep_the_blocks_path() -> None:
    """The op attends a prefix of each source's keys: a left-padded source (real keys not a prefix) has
    no row_sources, and the stack runs its blocks."""
    from models.kv_cache import CrossCache

    k = torch.zeros(2, 4, 3, 64)  # (N, K, S, D)
    right = CrossCache.build([(k, k)], torch.tensor([[True, True, False], [True, True, True]]))
    left = CrossCache.build([(k, k)], torch.tensor([[False, True, True], [True, True, True]]))
    sources, lengths = right.row_sources()
    assert sources.view(-1).tolist() == [0, 1] and lengths.tolist() == [2, 3]
    assert left.row_sources() is None
    grouped = right.grouped(torch.tensor([0, 1, 4]), width=4)  # two beams of source 0, one of source 1
    sources, lengths = grouped.row_sources()
    assert sources.view(-1).tolist() == [0, 0, 1] and lengths.tolist() == [2, 2, 3]


def fast_encoder(weights: str = "f32") -> EncoderModel:
    """tiny:encoder at MiniLM's head shape (12 heads of D = 32, post-norm LayerNorm, GELU, learned
    positions, token types), fused and packed (or 8-bit blocks) as load_model leaves it."""
    base, _ = tiny_model("encoder")
    torch.manual_seed(0)
    model = fuse_projections(EncoderModel(base.cfg.replace(d_model=384, n_heads=12, d_ff=128)).eval())
    if weights != "f32":
        return quantize(model, weights)
    pack_dense(model, "panels")
    return model


def encoded(model: EncoderModel, rows: list[list[int]], left: bool, native: bool,
            monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states (B, T, C) and keep (B, T) of `rows` padded on one side, through the op or the blocks."""
    taken = []
    real = native_blocks.encode_layers
    monkeypatch.setattr(native_blocks, "encode_layers",
                        lambda *a: taken.append(1) or (real(*a) if native else None))
    t = max(map(len, rows))
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    keep = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        span = slice(t - len(r), t) if left else slice(0, len(r))
        ids[i, span], keep[i, span] = torch.tensor(r), True
    with torch.inference_mode():
        hidden = model(ids, keep)
    monkeypatch.undo()
    assert taken == [1]
    return hidden, keep


@pytest.mark.parametrize("weights", ["f32", "q8_0"])
@pytest.mark.parametrize("left", [False, True])
def test_native_encoder_equals_the_blocks(weights: str, left: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder's forward pass through the op over the real tokens: the blocks' hidden states at every
    real token (to float32 rounding; the block formats' activation codes), zeros at padding."""
    model = fast_encoder(weights)
    rows = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0][3:]]
    blocks, keep = encoded(model, rows, left, False, monkeypatch)
    native, _ = encoded(model, rows, left, True, monkeypatch)
    torch.testing.assert_close(native[keep], blocks[keep], rtol=1e-5, atol=1e-5 if weights == "f32" else 1e-4)
    assert not native[~keep].any()
    torch.testing.assert_close(model.pool(native, keep), model.pool(blocks, keep),
                               rtol=1e-5, atol=1e-5 if weights == "f32" else 1e-4)


@pytest.mark.parametrize("left", [False, True])
def test_native_encoder_gives_a_sequence_the_same_bits_alone(left: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fast_encoder()
    together, keep = encoded(model, PROMPTS, left, True, monkeypatch)
    for i, row in enumerate(PROMPTS):
        alone, _ = encoded(model, [row], left, True, monkeypatch)
        assert torch.equal(together[i][keep[i]], alone[0]), f"row {i}"


def test_an_unpadded_batch_gives_the_bits_of_the_same_rows_among_padded_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows without padding take the op with cached indices (no mask arithmetic, models/native_blocks.py):
    the same bits as the same rows in a padded batch, which derives its indices from the mask."""
    model = fast_encoder()
    rows = [[5, 80, 81, 9, 70], [100, 7, 1, 3, 4], [33, 34, 35, 36, 37]]
    keeps: list[object] = []
    real = native_blocks.encode_layers
    monkeypatch.setattr(native_blocks, "encode_layers", lambda *a: keeps.append(a[2]) or real(*a))
    with torch.inference_mode():
        unpadded = model(torch.tensor(rows), torch.ones(3, 5, dtype=torch.bool))
        padded = model(torch.tensor([r + [0] for r in rows] + [[9, 8, 7, 6, 5, 4]]),
                       torch.tensor([[True] * 5 + [False]] * 3 + [[True] * 6]))
        assert torch.equal(model.pool(unpadded, torch.ones(3, 5, dtype=torch.bool)),
                           model.pool(padded[:3, :5], torch.ones(3, 5, dtype=torch.bool)))
    assert keeps[0] is None and keeps[1] is not None
    assert torch.equal(unpadded, padded[:3, :5])


@needs_kernels
def test_a_search_resolves_the_native_step_once_per_row_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """BeamSearch keeps its step's StepPlan while the rows stay as they are (a plan per layout, not per
    step) and gets the tokens it gets with a plan built every step; an assignment to any module makes
    a plan stale."""
    model = translator()
    params = [BeamParams(1, 12), BeamParams(3, 12), BeamParams(1, 12)]
    real = model.decode_plan
    built: list[int] = []
    monkeypatch.setattr(model, "decode_plan", lambda *a: built.append(a[2]) or real(*a))
    search = BeamSearch(model, 5, 12)
    search.add(SOURCES, params, keys=range(3))
    steps, layouts, out = 0, set(), {}
    while search:
        layouts.add(tuple((r.slot, r.rows) for r in search._live))
        steps += 1
        out |= {e.key: e.ids for e in search.step() if e.done}
    assert 0 < len(built) == len(layouts) < steps, (built, steps)
    monkeypatch.setattr(model, "decode_plan", lambda *a: None)  # no plan kept: each step resolved alone, head after
    assert translate_ids(model, SOURCES, params) == [out[i] for i in range(3)]
    cross = model.cross_cache(model.encode(torch.tensor([SOURCES[1]])), torch.ones(1, len(SOURCES[1]), dtype=torch.bool))
    plan = real(cross, PagedKVCache.for_model(model.cfg, 1, 4, 16).view(0, 1), 1)
    assert plan is not None and plan.current(cross, 1) and not plan.current(cross, 2)
    block = model.decoder.blocks[0]
    block.ff_norm = block.ff_norm  # an assignment (as quantizing or packing a module makes)
    assert not plan.current(cross, 1)
