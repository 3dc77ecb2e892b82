"""Prompt attention from a paged pool (models/kernels/prompt_attention.cpp): equal to softmax attention
over each row's keys, and a row's output bitwise the same alone, among other rows, and whether its
prompt is computed whole or in chunks after its cached keys; the model on a paged cache through it.

Dimension legend: B rows, H query heads, K kv heads, T query tokens, D head dim, BS slots a block.
"""

from __future__ import annotations

import pytest
import torch

from models.cache.paged import PagedKVCache
from models.decoder import DecoderLM
from models.kernels import native
from models.projections.dense import pack_dense
from models.tiny import tiny_model
from tests.models.cache.test_paged import PROMPTS, gqa_model, run
from tests.models.projections.test_quant import needs_kernels

pytestmark = [needs_kernels, pytest.mark.usefixtures("one_torch_thread")]

BS = 16


def pools(blocks: int, k: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key and value pools, (blocks * K * BS + 1, D) each."""
    return tuple(torch.randn(blocks * k * BS + 1, d).to(dtype) for _ in range(2))


def tables_for(past: list[int], t: int) -> torch.Tensor:
    """(B, M): row b's blocks for past[b] + t keys, shuffled over the pool (block 0 is the null block)."""
    need = [-(-(p + t) // BS) for p in past]
    ids = (torch.randperm(sum(need)) + 1).tolist()
    table = torch.zeros(len(past), max(need), dtype=torch.long)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    return table


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, past: list[int],
              k: int, scale: float) -> torch.Tensor:
    """Softmax attention in float64 over each row's keys 0 .. past + t: (B, H, T, D)."""
    b, h, t, d = q.shape
    out = torch.empty(b, h, t, d, dtype=torch.float64)
    for row in range(b):
        n = past[row] + t
        blocks = k_pool[:-1].view(-1, k, BS, d), v_pool[:-1].view(-1, k, BS, d)  # (N, K, BS, D)
        keys, values = (x[tables[row]].transpose(0, 1).reshape(k, -1, d)[:, :n].double()
                        .repeat_interleave(h // k, 0) for x in blocks)  # (H, n, D)
        scores = q[row].double() @ keys.transpose(1, 2) * scale  # (H, T, n)
        pos = past[row] + torch.arange(t)[:, None]  # (T, 1)
        scores = scores.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        out[row] = torch.softmax(scores, -1) @ values  # (H, T, D)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "k", "d", "t", "past"), [
    (6, 2, 64, 70, [0, 16, 45]),  # SmolLM2's grouping (G = 3), rows after cached keys, off block bounds
    (4, 4, 32, 9, [0, 130]),  # no grouping, a short chunk after many keys
    (8, 2, 128, 150, [3]),  # G = 4, several key tiles
])
def test_it_equals_softmax_attention_and_a_row_keeps_its_bits(dtype: torch.dtype, h: int, k: int, d: int, t: int,
                                                               past: list[int]) -> None:
    torch.manual_seed(0)
    k_pool, v_pool = pools(int(sum(-(-(p + t) // BS) for p in past)) + 1, k, d, dtype)
    tables = tables_for(past, t)
    q = torch.randn(len(past), h, t, d)
    op, scale = torch.ops.ts_panels.paged_prompt, d ** -0.5
    keys = torch.tensor(past) + t
    out = op(q, k_pool, v_pool, tables, keys, k, BS, scale)  # (B, H, T, D)
    assert out.shape == q.shape and out.permute(0, 2, 1, 3).is_contiguous()  # a view of (B, T, H, D)
    torch.testing.assert_close(out.double(), reference(q, k_pool, v_pool, tables, past, k, scale),
                               rtol=1e-5, atol=2e-6)
    for row in range(len(past)):  # alone: the same bits
        alone = op(q[row:row + 1], k_pool, v_pool, tables[row:row + 1], keys[row:row + 1], k, BS, scale)
        assert torch.equal(alone[0], out[row])
    for cut in (1, t // 3, t - 1):  # in two chunks, the second after the first's keys: the same bits
        first = op(q[:, :, :cut], k_pool, v_pool, tables, torch.tensor(past) + cut, k, BS, scale)
        second = op(q[:, :, cut:], k_pool, v_pool, tables, keys, k, BS, scale)
        assert torch.equal(torch.cat([first, second], 2), out), cut


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_products_stay_close_and_a_row_keeps_its_bits(dtype: torch.dtype) -> None:
    """The AVX512-BF16 build's bfloat16 products (q and the weights rounded to bfloat16): within
    bfloat16's rounding of softmax attention, and the same row-wise bits as the float32 products; other
    builds refuse them."""
    torch.manual_seed(2)
    h, k, d, t, past = 6, 2, 64, 70, [0, 16, 45]
    k_pool, v_pool = pools(int(sum(-(-(p + t) // BS) for p in past)) + 1, k, d, dtype)
    tables, q, keys = tables_for(past, t), torch.randn(len(past), h, t, d), torch.tensor(past) + t
    op, scale = torch.ops.ts_panels.paged_prompt, d ** -0.5
    if not native.has_bf16():
        with pytest.raises(RuntimeError, match="bfloat16 products need the AVX512-BF16 build"):
            op(q, k_pool, v_pool, tables, keys, k, BS, scale, True)
        return
    out = op(q, k_pool, v_pool, tables, keys, k, BS, scale, True)  # (B, H, T, D)
    want = reference(q, k_pool, v_pool, tables, past, k, scale)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-2)
    assert not torch.equal(out, op(q, k_pool, v_pool, tables, keys, k, BS, scale))  # it did round
    for row in range(len(past)):
        alone = op(q[row:row + 1], k_pool, v_pool, tables[row:row + 1], keys[row:row + 1], k, BS, scale, True)
        assert torch.equal(alone[0], out[row])
    for cut in (1, 25, t - 1):  # an odd cut splits a pair of keys: the pair's other weight is exactly 0
        first = op(q[:, :, :cut], k_pool, v_pool, tables, torch.tensor(past) + cut, k, BS, scale, True)
        second = op(q[:, :, cut:], k_pool, v_pool, tables, keys, k, BS, scale, True)
        assert torch.equal(torch.cat([first, second], 2), out), cut


def test_queries_with_strides_and_later_keys_change_nothing() -> None:
    """q as the fused projection leaves it (a slice of (B, H + K, T, D)); the keys after a row's last
    query (what a longer prompt in the same blocks would have written) are never read."""
    torch.manual_seed(1)
    h, k, d, t = 6, 2, 64, 33
    k_pool, v_pool = pools(8, k, d, torch.float32)
    tables = tables_for([0], 64)
    qk = torch.randn(1, h + k, t, d)
    q = qk[:, :h]
    op = torch.ops.ts_panels.paged_prompt
    out = op(q, k_pool, v_pool, tables, torch.tensor([t]), k, BS, 0.125)
    later_k, later_v = k_pool[:-1].view(-1, k, BS, d), v_pool[:-1].view(-1, k, BS, d)  # (N, K, BS, D) views
    for i, block in enumerate(tables[0].tolist()):  # scribble on every slot past position t - 1 of the row
        for s in range(BS):
            if i * BS + s >= t:
                later_k[block, :, s] = 1e4
                later_v[block, :, s] = -1e4
    assert torch.equal(op(q.contiguous(), k_pool, v_pool, tables, torch.tensor([t]), k, BS, 0.125), out)


def test_it_refuses_what_it_cannot_read() -> None:
    pool = torch.zeros(2 * 1 * BS + 1, 64)
    op = torch.ops.ts_panels.paged_prompt
    with pytest.raises(RuntimeError, match="names block 5 outside the pool"):
        op(torch.zeros(1, 1, 3, 64), pool, pool, torch.tensor([[5]]), torch.tensor([3]), 1, BS, 1.0)
    with pytest.raises(RuntimeError, match="has 2 keys for 3 queries"):
        op(torch.zeros(1, 1, 3, 64), pool, pool, torch.tensor([[1]]), torch.tensor([2]), 1, BS, 1.0)
    with pytest.raises(RuntimeError, match="head dims"):
        op(torch.zeros(1, 1, 3, 40), torch.zeros(33, 40), torch.zeros(33, 40), torch.tensor([[1]]),
           torch.tensor([3]), 1, BS, 1.0)


def heads_of_32() -> DecoderLM:
    """4 query heads on 4 kv heads of 32 dims."""
    model, _ = tiny_model("decoder")
    torch.manual_seed(0)
    return DecoderLM(model.cfg.replace(d_model=128, n_heads=4, n_kv_heads=4, d_ff=64, max_positions=128)).eval()


@pytest.mark.parametrize("shape", ["heads of 32", "gqa"])
def test_the_model_through_it_equals_the_gathered_path(shape: str) -> None:
    """A right-padded prefill of 19, 4 and 1 tokens and 20 decode steps on a paged cache: the logits
    with prompts through the kernel equal those through SDPA on the gathered keys, to float32 rounding."""
    model = heads_of_32() if shape == "heads of 32" else gqa_model()
    caches = [PagedKVCache.for_model(model.cfg, rows=3, blocks=20, max_len=64, prompt_kernel=on) for on in (False, True)]
    assert caches[1].prompt_kernel and not caches[0].prompt_kernel
    sdpa, kernel = (run(model, c, PROMPTS, 20) for c in caches)
    for step, (a, b) in enumerate(zip(sdpa, kernel, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_the_model_computes_a_prompt_in_chunks_with_the_bits_of_it_whole() -> None:
    """Through the kernel, on our panel projections (a row's bits never depend on the other rows), a
    prompt prefilled in chunks of 5 (each after the keys of the ones before) leaves the very
    keys/values and last logits of the prompt prefilled at once."""
    model = gqa_model()
    pack_dense(model, "panels")
    prompt = torch.randint(1, model.cfg.vocab_size, (1, 23))
    whole = PagedKVCache.for_model(model.cfg, rows=1, blocks=8, max_len=64)
    chunked = PagedKVCache.for_model(model.cfg, rows=1, blocks=8, max_len=64)
    assert whole.prompt_kernel
    with torch.inference_mode():
        want = model(prompt, cache=whole.view())[:, -1]  # (1, V)
        whole.advance([23])
        for start in range(0, 23, 5):
            got = model(prompt[:, start:start + 5], cache=chunked.view())[:, -1]  # (1, V)
            chunked.advance([min(5, 23 - start)])
    assert torch.equal(got, want)
    n = whole.host_tables[0]
    for a, b in zip(whole.block_kv(n[0]) + whole.block_kv(n[1]), chunked.block_kv(chunked.host_tables[0][0])
                    + chunked.block_kv(chunked.host_tables[0][1]), strict=True):
        assert torch.equal(a, b)
