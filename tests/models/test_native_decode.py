"""models/native_decode.py: a Llama-style stack's decode step as one native op per layer equals the
blocks' own path (to float32 rounding), gives a row the same bits alone and among others, and is
taken exactly where it computes what the blocks compute.

Dimension legend: B rows, V vocabulary, C model dim.
"""

from __future__ import annotations

import pytest
import torch

from models import native_decode
from models.decoder import DecoderLM
from models.decoding import SamplingParams
from models.dense import pack_dense
from models.fuse import fuse_projections
from models.generate import generate
from models.paged_cache import PagedKVCache
from models.quant import quantize
from models.tiny import tiny_model

from .test_paged_cache import PROMPTS, gqa_model, run
from .test_quant import needs_kernels

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), needs_kernels]


def fast_model(weights: str) -> DecoderLM:
    """SmolLM2's attention shape in small (G = 3, D = 64), its projections fused, then as the shipped
    generator holds them (q4_1 blocks, a Q8_0 head) or as float32 panels."""
    model = fuse_projections(gqa_model())
    if weights == "q4_1":
        return quantize(model, "q4_1")
    pack_dense(model, "panels")
    return model


def steps(model: DecoderLM, native: bool, monkeypatch: pytest.MonkeyPatch, prompts=PROMPTS) -> list[torch.Tensor]:
    """Each step's logits (B, V) of a prefill and 20 greedy decode steps on a paged cache, with the decode
    steps through decode_layer or through the blocks."""
    taken = []
    real = native_decode.decode_layers

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        taken.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(native_decode, "decode_layers", spy)
    if not native:
        monkeypatch.setattr(native_decode, "runs", lambda *a: False)
    out = run(model, PagedKVCache.for_model(model.cfg, rows=len(prompts), blocks=20, max_len=64), prompts, 20)
    monkeypatch.undo()
    one_token = max(map(len, prompts)) == 1  # a prefill of one token per row is a decode step too
    assert len(taken) == ((20 + one_token) if native else 0)  # every one-token step, and only those, took the op
    return out


@pytest.mark.parametrize("weights", ["q4_1", "f32"])
def test_native_decode_equals_the_blocks(weights: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fast_model(weights)
    assert native_decode.stack_args(model.stack.blocks) is not None
    blocks = steps(model, False, monkeypatch)
    native = steps(model, True, monkeypatch)
    # the 4-bit blocks quantize activations: fp32 rounding that differs (the glue's order) can move one
    # across a step of its 16-bit (two-part) codes, ~1e-5 of the group's largest input (test_compiled)
    atol = 1e-4 if weights == "q4_1" else 1e-5
    for step, (b, n) in enumerate(zip(blocks, native, strict=True)):
        torch.testing.assert_close(n, b, rtol=1e-5, atol=atol, msg=f"step {step}")
        assert torch.equal(n.argmax(-1), b.argmax(-1))


def test_native_decode_gives_a_row_the_same_bits_alone_and_among_others(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fast_model("q4_1")
    together = steps(model, True, monkeypatch)
    for row, prompt in enumerate(PROMPTS):
        alone = steps(model, True, monkeypatch, [prompt])
        for step, (t, a) in enumerate(zip(together, alone, strict=True)):
            assert torch.equal(t[row], a[0]), f"row {row}, step {step}"


def test_generate_decodes_through_the_op_and_keeps_its_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline loop (models.generate) decodes on the paged cache the engine uses, so it takes the op,
    and gives the tokens of the blocks' path."""
    model = fast_model("q4_1")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    calls = []
    real = native_decode.decode_layers
    monkeypatch.setattr(native_decode, "decode_layers", lambda *a: calls.append(1) or real(*a))
    fast = [g.tokens for g in generate(model, PROMPTS, params)]
    assert len(calls) == 11
    monkeypatch.setattr(native_decode, "runs", lambda *a: False)
    assert [g.tokens for g in generate(model, PROMPTS, params)] == fast


def test_other_blocks_keep_their_own_path() -> None:
    """A stack is taken only when decode_layer computes every block the way the block does."""
    model = fast_model("q4_1")
    assert native_decode.stack_args(model.stack.blocks) is not None
    plain, _ = tiny_model("decoder")  # unfused nn.Linear projections
    assert native_decode.stack_args(plain.stack.blocks) is None
    qk = fuse_projections(DecoderLM(gqa_model().cfg.replace(qk_norm=True)).eval())
    assert native_decode.stack_args(quantize(qk, "q4_1").stack.blocks) is None
    post = fuse_projections(DecoderLM(gqa_model().cfg.replace(prenorm=False)).eval())
    assert native_decode.stack_args(quantize(post, "q4_1").stack.blocks) is None
    model.train()
    assert native_decode.stack_args(model.stack.blocks) is None


def test_the_arguments_follow_the_model_after_load() -> None:
    """stack_args is cached per stack, and rebuilt when what it read changes: the activation bits, a
    projection swapped, train mode."""
    from models.panels import set_activation_bits

    model = fast_model("q4_1")
    first = native_decode.stack_args(model.stack.blocks)
    assert first is not None and native_decode.stack_args(model.stack.blocks) is first  # cached
    assert {p for layer in first for p in layer[7]} == {2}  # two 8-bit activation parts
    set_activation_bits(model, 8)
    eight = native_decode.stack_args(model.stack.blocks)
    assert eight is not first and {p for layer in eight for p in layer[7]} == {1}
    attn = model.stack.blocks[1].self_attn
    attn.qkv = torch.nn.Linear(attn.qkv.in_features, attn.qkv.out_features, bias=False)
    assert native_decode.stack_args(model.stack.blocks) is None
