"""models/execution/native.py: the native backend (a whole stack in one call of our C++ kernels) equals the
torch backend, the model's own forward, to float32 rounding, gives a row the same bits alone and among
others, and is planned exactly where it computes what the blocks compute (with the reason elsewhere).
Llama-style decoders, post-norm LayerNorm decoders, encoder-decoders with cross-attention, encoders.

Dimension legend: B rows, V vocabulary, C model dim.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.beam_search import BeamParams, BeamSearch, translate_ids
from models.cache.paged import PagedKVCache
from models.decoder import DecoderLM
from models.decoding import SamplingParams
from models.encoder import EncoderModel
from models.execution.executors import DecoderExecutor, Seq2SeqExecutor
from models.execution.plan import PlanError
from models.execution.planner import Runtime, plan_model
from models.generate import generate
from models.inputs import PaddedBatch
from models.projections.dense import pack_dense
from models.projections.fuse import fuse_projections
from models.projections.quant import quantize
from models.seq2seq import Seq2Seq
from models.tiny import SEQ2SEQ_SPREAD, tiny_model
from tests.models.cache.test_paged import PROMPTS, gqa_model
from tests.models.projections.test_quant import needs_kernels

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


class Counted:
    """A backend wrapped to count its calls (and remember each call's arguments)."""

    def __init__(self, backend: object) -> None:
        self.backend, self.calls = backend, []

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.calls.append(args)
        return self.backend(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self.backend, name)


def steps(model: DecoderLM, backend: str, prompts=PROMPTS, kv: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Each step's logits (B, V) of a right-padded prefill and 20 greedy decode steps on a paged cache
    of `kv`, the decode steps on `backend` ("native" or "torch")."""
    executor = plan_model(model, {"decode": backend}, Runtime(kv_dtype=kv))
    assert executor.plan.backend("decode") == backend
    if backend == "native":
        executor.step = Counted(executor.step)
    out = run(executor, PagedKVCache.for_model(model.cfg, rows=len(prompts), blocks=20, max_len=64, dtype=kv),
              prompts, 20)
    if backend == "native":
        assert len(executor.step.calls) == 20  # every decode step, and only those, took the native step
    return out


def run(executor: DecoderExecutor, cache: PagedKVCache, prompts: list[list[int]], n: int) -> list[torch.Tensor]:
    """A right-padded prefill of `prompts`, then n greedy decode steps: each step's logits (B, V)."""
    padded = PaddedBatch.from_token_lists(prompts)  # (B, T)
    out = []
    with torch.inference_mode():
        logits = executor.prefill(padded.ids, cache.view(), padded.last_index())[:, 0]  # (B, V)
        cache.advance(padded.lengths)
        for _ in range(n):
            out.append(logits)
            logits = executor.decode(logits.argmax(-1)[:, None], cache.view())[:, 0]  # (B, V)
            cache.advance(1)
    return out + [logits]


@pytest.mark.parametrize(("weights", "changes"), [
    ("q4_1", {}), ("f32", {}), ("f32", POST_NORM), ("q8_0", {**POST_NORM, "activation": "relu", "n_kv_heads": 6}),
    ("f32", {"activation": "gelu_tanh", "norm": "layernorm", "norm_bias": False}),
])
def test_native_blocks_equals_the_blocks(weights: str, changes: dict) -> None:
    model = fast_model(weights, **changes)
    blocks = steps(model, "torch")
    fast = steps(model, "native")
    # the block formats quantize activations: fp32 rounding that differs (the glue's order) can move one
    # across a step of its 16-bit (two-part) codes, ~1e-5 of the group's largest input (test_compiled)
    atol = 1e-4 if weights != "f32" else 1e-5
    for step, (b, n) in enumerate(zip(blocks, fast, strict=True)):
        torch.testing.assert_close(n, b, rtol=1e-5, atol=atol, msg=f"step {step}")
        assert torch.equal(n.argmax(-1), b.argmax(-1))


def decoded_apart(executor: DecoderExecutor, prompts: list[list[int]], n: int,
                  kv: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Each prompt prefilled on its own (its own row of one paged cache of `kv`, the same computation
    whatever else is in the batch: a padded prefill is not what is tested here), then n greedy decode
    steps of all rows together: each decode step's logits (B, V)."""
    cache = PagedKVCache.for_model(executor.model.cfg, rows=len(prompts), blocks=20, max_len=64, dtype=kv)
    first = []
    with torch.inference_mode():
        for row, p in enumerate(prompts):
            first.append(executor.prefill(torch.tensor([p]), cache.view(row, row + 1),
                                          torch.tensor([len(p) - 1]))[:, -1])  # (1, V)
            cache.advance([len(p)], row, row + 1)
        logits, out = torch.cat(first), []  # (B, V)
        for _ in range(n):
            logits = executor.decode(logits.argmax(-1)[:, None], cache.view())[:, 0]  # (B, V)
            cache.advance(1)
            out.append(logits)
    return out


@pytest.mark.parametrize("weights", ["q4_1", "f32"])
def test_native_blocks_on_a_bfloat16_cache_equals_the_blocks(weights: str) -> None:
    """A bfloat16 KV cache: the op's steps (keys and values rounded as it writes them) give the blocks'
    logits on the same cache (torch's rounding), and the plan says which cache it runs on."""
    model = fast_model(weights)
    plan = plan_model(model, {"decode": "native"}, Runtime(kv_dtype=torch.bfloat16)).plan
    assert "bfloat16 KV" in plan["decode"].detail
    blocks = steps(model, "torch", kv=torch.bfloat16)
    fast = steps(model, "native", kv=torch.bfloat16)
    wide = steps(model, "native")
    atol = 1e-4 if weights != "f32" else 1e-5
    for step, (b, n) in enumerate(zip(blocks, fast, strict=True)):
        torch.testing.assert_close(n, b, rtol=1e-5, atol=atol, msg=f"step {step}")
    assert not torch.equal(fast[1], wide[1])  # the cache is narrower than float32


@pytest.mark.parametrize(("weights", "kv"), [("q4_1", torch.float32), ("f32", torch.float32),
                                             ("q4_1", torch.bfloat16)])
def test_native_blocks_gives_a_row_the_same_bits_alone_and_among_others(weights: str, kv: torch.dtype) -> None:
    """Rows of 19, 4 and 2 tokens (different key counts every step): a row's decode steps through the op
    give the same bits alone and among the others."""
    executor = plan_model(fast_model(weights), {"decode": "native"}, Runtime(kv_dtype=kv))
    prompts = [PROMPTS[0], PROMPTS[1], [50, 51]]
    together = decoded_apart(executor, prompts, 20, kv)
    for row, prompt in enumerate(prompts):
        alone = decoded_apart(executor, [prompt], 20, kv)
        for step, (t, a) in enumerate(zip(together, alone, strict=True)):
            assert torch.equal(t[row], a[0]), f"row {row}, step {step}"


def test_generate_decodes_through_the_op_and_keeps_its_tokens() -> None:
    """The offline loop (models.generate) decodes on the paged cache the engine uses, on its model's
    plan ("auto" picks native here), and gives the torch backend's tokens."""
    model = fast_model("q4_1")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    executor = plan_model(model)
    assert executor.plan.backend("decode") == "native"
    executor.step = Counted(executor.step)
    fast = [g.tokens for g in generate(executor, PROMPTS, params)]
    assert len(executor.step.calls) == 11
    assert [g.tokens for g in generate(plan_model(model, "torch"), PROMPTS, params)] == fast


def reason(model: torch.nn.Module, phase: str = "decode") -> str:
    """Why the plan does not run `phase` natively ("" where it does)."""
    plan = plan_model(model).plan[phase]
    return "" if plan.backend == "native" else plan.not_taken["native"]


def test_other_blocks_keep_their_own_path() -> None:
    """A stack is planned native only when the native step computes every block the way the block does;
    elsewhere the plan names the reason, and asking for native by name fails the load with it."""
    assert reason(fast_model("q4_1")) == ""
    plain, _ = tiny_model("decoder")  # unfused nn.Linear projections
    assert "fused q/k/v" in reason(plain)
    with pytest.raises(PlanError, match="decode on native: needs fused q/k/v"):
        plan_model(plain, {"decode": "native"})
    qk = fuse_projections(DecoderLM(gqa_model().cfg.replace(qk_norm=True)).eval())
    assert "q/k norms" in reason(quantize(qk, "q4_1"))
    post = fuse_projections(DecoderLM(gqa_model().cfg.replace(prenorm=False)).eval())
    assert reason(quantize(post, "q4_1")) == ""  # post-norm is served
    int8 = quantize(fuse_projections(gqa_model()), "int8")  # fbgemm's dynamic int8 Linear: not one of ours
    assert "Int8Linear" in reason(int8)
    windowed = fast_model("q4_1", sliding_window=8)
    assert "sliding window" in reason(windowed)
    model = fast_model("q4_1")
    model.train()
    assert "eval mode" in reason(model)
    model.eval()
    rows = plan_model(model, runtime=Runtime(paged=False)).plan["decode"]
    assert rows.backend == "torch" and rows.not_taken["native"].startswith("needs a paged KV cache")


def test_the_arguments_follow_the_model_after_load() -> None:
    """A plan reads the model as it is when planned (the activation bits, the projections, train
    mode); a change afterwards needs a new plan, which reads it."""
    from models.projections.panels import set_activation_bits

    model = fast_model("q4_1")
    first = plan_model(model).step.stack
    assert {p for layer in first.layers for p in layer.parts} == {2}  # two 8-bit activation parts
    set_activation_bits(model, 8)
    eight = plan_model(model).step.stack
    assert {p for layer in eight.layers for p in layer.parts} == {1}
    assert {p for layer in first.layers for p in layer.parts} == {2}  # the first plan is as it was built
    attn = model.stack.blocks[1].self_attn
    attn.qkv = torch.nn.Linear(attn.qkv.in_features, attn.qkv.out_features, bias=False)
    assert "qkv projection is Linear (block 1)" in reason(model)


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


def cross_steps(executor: Seq2SeqExecutor, sources: list[list[int]], n: int,
                rows: list[int] | None = None) -> list[torch.Tensor]:
    """Encode `sources` (right-padded), then n greedy decode steps on a paged cache for the sources at
    `rows` (all by default): each step's logits (B, V)."""
    model = executor.model
    src = PaddedBatch.from_token_lists(sources, model.cfg.pad_token_id)
    rows = list(range(len(sources))) if rows is None else rows
    cache = PagedKVCache.for_model(model.cfg, len(rows), blocks=4 * len(rows), max_len=n + 1)
    tokens = torch.full((len(rows), 1), model.cfg.decoder_start_token_id)  # (B, 1)
    out = []
    with torch.inference_mode():
        cross = executor.encode(src.ids, src.keep).select(torch.tensor(rows))
        for _ in range(n):
            logits = executor.decode(tokens, cross, cache.view())[:, -1]  # (B, V)
            cache.advance(1)
            out.append(logits)
            tokens = logits.argmax(-1, keepdim=True)  # (B, 1)
    return out


@pytest.mark.parametrize("weights", ["f32", "q8_0"])
def test_native_cross_attention_step_equals_the_blocks(weights: str) -> None:
    """An encoder-decoder's decode steps (post-norm, cross-attention over right-padded sources of 3 to 13
    tokens) on the native backend: the torch backend's logits to float32 rounding."""
    model = translator(weights)
    executor = plan_model(model, "native")
    # 8-bit blocks: a bias after the head is not one the native head adds, so the head follows the step
    assert (executor.step.head is None) == (weights != "f32")
    assert ("final_logits_bias" in executor.plan["decode"].detail) == (weights != "f32")
    executor.step = Counted(executor.step)
    blocks = cross_steps(plan_model(model, "torch"), SOURCES, 12)
    fast = cross_steps(executor, SOURCES, 12)
    assert len(executor.step.calls) == 12
    for step, (b, n) in enumerate(zip(blocks, fast, strict=True)):
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
def test_the_op_embeds_and_norms_as_the_modules_do(which: str) -> None:
    """A decode step's embedding inside the op (the token's row, times the scale, plus the position's
    row: learned, sinusoidal, or none with rotary) gives the bits of Embeddings.forward passed in as the
    op's input; the stack's final norm inside the op equals the module's to float32 rounding."""
    model = EMBEDDINGS[which]()
    executor = plan_model(model, {"decode": "native"})
    step = executor.step
    assert step.embedding is not None

    def logits(**changes: object) -> list[torch.Tensor]:
        executor.step = dataclasses.replace(step, **changes)
        if isinstance(model, Seq2Seq):
            return cross_steps(executor, SOURCES, 8)
        return run(executor, PagedKVCache.for_model(model.cfg, rows=len(PROMPTS), blocks=20, max_len=64), PROMPTS, 20)

    inside, given = logits(), logits(embedding=None)
    for i, (a, b) in enumerate(zip(inside, given, strict=True)):
        assert torch.equal(a, b), f"step {i}"
    if model_norm(model) is not None:  # the post-norm decoders have none
        assert step.final is not None
        apart = logits(final=None)
        for i, (a, b) in enumerate(zip(inside, apart, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {i}")


def model_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    return (model.decoder if isinstance(model, Seq2Seq) else model.stack).norm


def test_the_op_applies_the_head_as_the_model_does() -> None:
    """A translator's decode step with its head inside the op (the packed head and Marian's
    final_logits_bias, added as each logit is stored) gives the bits of the head applied after the op;
    the native plan is taken where the head is float32 panels, not where a bias would follow 8-bit blocks."""
    model = translator()
    with torch.no_grad():
        model.final_logits_bias.copy_(torch.linspace(-3, 3, model.cfg.vocab_size))  # a bias that shows
    executor = plan_model(model)
    assert executor.plan.backend("decode") == "native" and executor.step.head is not None
    inside = cross_steps(executor, SOURCES, 10)
    executor.step = dataclasses.replace(executor.step, head=None)
    after = cross_steps(executor, SOURCES, 10)
    for step, (a, b) in enumerate(zip(inside, after, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    assert plan_model(translator("q8_0")).step.head is None


def test_native_cross_attention_gives_a_row_the_same_bits_alone() -> None:
    """Decoder rows of the same encoder output (one encoder pass: its padded batch is not what is tested
    here) give the same bits alone and among others."""
    executor = plan_model(translator(), "native")
    together = cross_steps(executor, SOURCES, 10)
    for row in range(len(SOURCES)):
        alone = cross_steps(executor, SOURCES, 10, rows=[row])
        for step, (t, a) in enumerate(zip(together, alone, strict=True)):
            assert torch.equal(t[row], a[0]), f"row {row}, step {step}"


@pytest.fixture(scope="module")
def shipped_translator():
    """The committed en->es translator with every float projection as panels (the op's layout; "auto"
    keeps the fastest kernel per shape on the machine), and the first 24 held-out sentences."""
    from pathlib import Path

    from models.catalog import DEFAULT_SPECS, load_model
    from models.train.eval_translator import read_test

    loaded = load_model(dataclasses.replace(DEFAULT_SPECS["translator"], dense_kernel="panels"),
                        Path("/nonexistent-cache"))
    sources, _ = read_test(Path(__file__).parents[3] / "models/weights/translator-en-es/test.tsv")
    return loaded, loaded.tokenizer.encode_batch(sources[:24])


@pytest.mark.parametrize("beam", [1, 4])
def test_beam_search_through_the_op_keeps_its_translations(beam: int, shipped_translator) -> None:
    """translate_ids (the offline search and the engine's BeamSearch, beams grouped per source) on the
    shipped translator, planned native for both phases as loaded, gives the torch backend's tokens,
    together and each source alone."""
    loaded, sources = shipped_translator
    assert [p.backend for p in loaded.plan.phases] == ["native", "native"]
    params = BeamParams(beam, 64)
    expected = translate_ids(plan_model(loaded.model, "torch"), sources, params)
    assert translate_ids(loaded.executor, sources, params) == expected
    assert [translate_ids(loaded.executor, [s], params)[0] for s in sources[:6]] == expected[:6]
    assert len({tuple(e) for e in expected}) == len(sources)  # the outputs depend on the source


def test_left_padded_sources_keep_the_blocks_path() -> None:
    """The op attends a prefix of each source's keys: a left-padded source (real keys not a prefix) has
    no row_sources, and the native step refuses it (the searches pad sources on the right)."""
    from models.cache.cross import CrossCache

    k = torch.zeros(2, 4, 3, 64)  # (N, K, S, D)
    right = CrossCache.build([(k, k)], torch.tensor([[True, True, False], [True, True, True]]))
    left = CrossCache.build([(k, k)], torch.tensor([[False, True, True], [True, True, True]]))
    sources, lengths = right.row_sources()
    assert sources.view(-1).tolist() == [0, 1] and lengths.tolist() == [2, 3]
    assert left.row_sources() is None
    grouped = right.grouped(torch.tensor([0, 1, 4]), width=4)  # two beams of source 0, one of source 1
    sources, lengths = grouped.row_sources()
    assert sources.view(-1).tolist() == [0, 0, 1] and lengths.tolist() == [2, 2, 3]
    step = plan_model(translator(), "native").step
    with pytest.raises(ValueError, match="right-padded"):
        step.cross_rows(CrossCache.build([(torch.zeros(2, 4, 3, 64),) * 2] * 2,
                                         torch.tensor([[False, True, True], [True, True, True]])))


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


def encoded(model: EncoderModel, rows: list[list[int]], left: bool, backend: str,
            adapters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states (B, T, C) and keep (B, T) of `rows` padded on one side, on `backend` (each row with
    its adapter slot in `adapters`)."""
    executor = plan_model(model, backend)
    if backend == "native":
        executor.blocks = Counted(executor.blocks)
    t = max(map(len, rows))
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    keep = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        span = slice(t - len(r), t) if left else slice(0, len(r))
        ids[i, span], keep[i, span] = torch.tensor(r), True
    with torch.inference_mode():
        hidden = executor.hidden(ids, keep, adapters=adapters)
    assert backend != "native" or len(executor.blocks.calls) == 1
    return hidden, keep


@pytest.mark.parametrize("weights", ["f32", "q8_0"])
@pytest.mark.parametrize("left", [False, True])
def test_native_encoder_equals_the_blocks(weights: str, left: bool) -> None:
    """An encoder's forward pass through the op over the real tokens: the blocks' hidden states at every
    real token (to float32 rounding; the block formats' activation codes), zeros at padding."""
    model = fast_encoder(weights)
    rows = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0][3:]]
    blocks, keep = encoded(model, rows, left, "torch")
    fast, _ = encoded(model, rows, left, "native")
    torch.testing.assert_close(fast[keep], blocks[keep], rtol=1e-5, atol=1e-5 if weights == "f32" else 1e-4)
    assert not fast[~keep].any()
    torch.testing.assert_close(model.pool(fast, keep), model.pool(blocks, keep),
                               rtol=1e-5, atol=1e-5 if weights == "f32" else 1e-4)


@pytest.mark.parametrize("left", [False, True])
def test_native_encoder_gives_a_sequence_the_same_bits_alone(left: bool) -> None:
    model = fast_encoder()
    together, keep = encoded(model, PROMPTS, left, "native")
    for i, row in enumerate(PROMPTS):
        alone, _ = encoded(model, [row], left, "native")
        assert torch.equal(together[i][keep[i]], alone[0]), f"row {i}"


def test_an_unpadded_batch_gives_the_bits_of_the_same_rows_among_padded_ones() -> None:
    """Rows without padding take the op with cached indices (no mask arithmetic): the same bits as the
    same rows in a padded batch, which derives its indices from the mask."""
    model = fast_encoder()
    executor = plan_model(model, "native")
    executor.blocks = Counted(executor.blocks)
    rows = [[5, 80, 81, 9, 70], [100, 7, 1, 3, 4], [33, 34, 35, 36, 37]]
    with torch.inference_mode():
        unpadded = executor.hidden(torch.tensor(rows), torch.ones(3, 5, dtype=torch.bool))
        padded = executor.hidden(torch.tensor([r + [0] for r in rows] + [[9, 8, 7, 6, 5, 4]]),
                                 torch.tensor([[True] * 5 + [False]] * 3 + [[True] * 6]))
        assert torch.equal(model.pool(unpadded, torch.ones(3, 5, dtype=torch.bool)),
                           model.pool(padded[:3, :5], torch.ones(3, 5, dtype=torch.bool)))
    keeps = [call[1] for call in executor.blocks.calls]
    assert keeps[0] is None and keeps[1] is not None
    assert torch.equal(unpadded, padded[:3, :5])


def test_a_search_resolves_the_native_step_once_per_row_layout() -> None:
    """BeamSearch keeps its step's cross-attention inputs while the rows stay as they are (once per
    layout, not per step) and gets the tokens it gets with them resolved every step."""
    executor = plan_model(translator(), "native")
    params = [BeamParams(1, 12), BeamParams(3, 12), BeamParams(1, 12)]
    real = executor.rows
    built: list[object] = []
    executor.rows = lambda cross: built.append(cross) or real(cross)
    search = BeamSearch(executor, 5, 12)
    search.add(SOURCES, params, keys=range(3))
    steps_taken, layouts, out = 0, set(), {}
    while search:
        layouts.add(tuple((r.slot, r.rows) for r in search._live))
        steps_taken += 1
        out |= {e.key: e.ids for e in search.step() if e.done}
    assert 0 < len(built) == len(layouts) < steps_taken, (built, steps_taken)
    # what a search keeps never matches its step's sources: each step resolves its own
    executor.rows = lambda cross: real(dataclasses.replace(cross))
    assert translate_ids(executor, SOURCES, params) == [out[i] for i in range(3)]
