"""PagedKVCache: the block allocator (references, sharing, copies, moves) and the model on it (paged =
dense, through the decode kernel and the gathered path; a row alone = among others, bitwise).

Dimension legend: R rows, B rows of a view, K kv heads, BS slots per block, T new tokens, D head dim.
"""

from __future__ import annotations

import os

import pytest
import torch

from models.cache.dense import KVCache
from models.cache.paged import CacheFull, PagedKVCache
from models.decoder import DecoderLM
from models.kernels import native
from models.tiny import tiny_model
from tests.models.projections.test_quant import needs_kernels

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small(blocks: int = 8, rows: int = 4) -> PagedKVCache:
    return PagedKVCache(n_layers=1, rows=rows, kv_heads=2, max_len=64, head_dim=3, blocks=blocks, block=4,
                        decode_kernel=False)


def test_blocks_are_taken_as_rows_grow_and_come_back_on_reset() -> None:
    cache = small()
    assert cache.blocks_total == cache.blocks_free == 7  # block 0 is the null block
    cache.ensure(0, 5)  # 2 blocks of 4
    cache.ensure(1, 4)
    assert [len(t) for t in cache.host_tables[:2]] == [2, 1] and cache.blocks_free == 4
    assert cache.usage() == 3 / 7
    assert 0 not in cache.host_tables[0] + cache.host_tables[1]
    assert cache.tables[0, :2].tolist() == cache.host_tables[0] and cache.tables[0, 2:].eq(0).all()
    cache.ensure(0, 8)  # still 2 blocks
    assert cache.blocks_free == 4
    with pytest.raises(CacheFull, match="needs 5 more KV blocks; 4 are free"):
        cache.ensure(2, 20)
    assert cache.host_tables[2] == [] and cache.blocks_free == 4  # nothing taken by a refusal
    cache.reset(0, 2)
    assert cache.blocks_free == 7 and cache.tables.eq(0).all()
    assert cache.usage() == 0.0


def test_a_copied_row_shares_its_full_blocks_and_copies_the_last_one() -> None:
    cache = small()
    cache.ensure(0, 6)
    cache.set_lengths(6, 0, 1)
    full, last = cache.host_tables[0]
    for t in cache.block_kv(last):
        t.fill_(7.0)
    cache.move_row(0, 1)
    assert cache.host_tables[1][0] == full and cache.host_tables[1][1] != last
    assert cache.refs(full) == 2 and cache.refs(last) == 1
    assert all(t.eq(7.0).all() for t in cache.block_kv(cache.host_tables[1][1]))
    assert cache.host_lengths[:2] == [6, 6]
    assert cache.usage() == 3 / 7  # the shared block counts once
    cache.ref(last)  # another holder (a prefix cache) keeps row 0's last block
    cache.reset(0, 1)
    assert cache.refs(full) == 1 and cache.blocks_free == 4  # the shared block stays with row 1
    assert cache.usage() == 2 / 7  # a block no row holds is not in use: its holder gives it up on demand


def test_relocate_moves_the_table_without_copying() -> None:
    cache = small()
    cache.ensure(2, 9)
    cache.set_lengths(9, 2, 3)
    blocks = list(cache.host_tables[2])
    cache.relocate(2, 0)
    assert cache.host_tables[0] == blocks and cache.host_tables[2] == []
    assert cache.host_lengths[0] == 9 and cache.host_lengths[2] == 0
    assert cache.tables[0, :3].tolist() == blocks and cache.tables[2].eq(0).all()
    assert cache.blocks_free == 7 - 3


def test_shared_blocks_are_freed_only_by_their_last_holder() -> None:
    cache = small()
    cache.ensure(0, 8)
    a, b = cache.host_tables[0]
    cache.ref(a)  # the prefix cache, say
    cache.share(1, [a])
    cache.reset(0, 2)
    assert cache.refs(a) == 1 and cache.refs(b) == 0 and cache.blocks_free == 6
    cache.unref(a)
    assert cache.blocks_free == 7


def test_padding_gets_no_blocks() -> None:
    model, _ = tiny_model("decoder")
    cache = PagedKVCache.for_model(model.cfg, rows=2, blocks=16, max_len=64, decode_kernel=False)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
                        [5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])  # (2, 18): row 1 has 3 real
    with torch.inference_mode():
        model(ids, cache=cache.view(), last=torch.tensor([17, 2]))
    assert [len(t) for t in cache.host_tables[:2]] == [2, 1]


def run(model: DecoderLM, cache, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Right-padded prefill of `prompts`, then `steps` greedy decode steps: each step's logits (B, V)."""
    b, t = len(prompts), max(map(len, prompts))
    ids = torch.zeros(b, t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    last = torch.tensor([len(p) - 1 for p in prompts])
    out = []
    with torch.inference_mode():
        logits = model(ids, cache=cache.view(), last=last)[:, 0]  # (B, V)
        cache.advance([len(p) for p in prompts])
        for _ in range(steps):
            out.append(logits)
            logits = model(logits.argmax(-1)[:, None], cache=cache.view())[:, 0]  # (B, V)
            cache.advance(1)
    return out + [logits]


def gqa_model() -> DecoderLM:
    """SmolLM2's attention shape in small: 6 query heads on 2 kv heads (G = 3), head dim 64."""
    model, _ = tiny_model("decoder")
    torch.manual_seed(0)
    return DecoderLM(model.cfg.replace(d_model=384, n_heads=6, n_kv_heads=2, d_ff=64, max_positions=128)).eval()


PROMPTS = [[3, 9, 4, 11, 2, 8, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42], [7, 7, 1, 2], [50]]


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("shape", ["tiny", "gqa"])
def test_paged_equals_dense(kernel: bool, shape: str) -> None:
    """Rows of 19, 4 and 1 prompt tokens, 20 steps (across block boundaries): the logits of every step
    equal the dense cache's (the kernel's own reduction order: to float32 rounding)."""
    if kernel and not native.available() and not os.environ.get("REQUIRE_NATIVE_KERNELS"):
        pytest.skip("no AVX2 or AVX-512 CPU, or no compiler, for the native kernels")
    model = tiny_model("decoder")[0] if shape == "tiny" else gqa_model()
    dense = run(model, KVCache.for_model(model.cfg, rows=3, max_len=64), PROMPTS, 20)
    paged = run(model, PagedKVCache.for_model(model.cfg, rows=3, blocks=20, max_len=64, decode_kernel=kernel),
                PROMPTS, 20)
    for step, (d, p) in enumerate(zip(dense, paged, strict=True)):
        torch.testing.assert_close(p, d, rtol=1e-5, atol=1e-5, msg=f"step {step}")


@needs_kernels
def test_the_kernel_gives_a_row_the_same_bits_alone_and_among_others() -> None:
    """The decode kernel on one pool: each row's output (B, H, D) is the same bits whatever rows run
    beside it, and equals softmax attention over the row's own keys."""
    torch.manual_seed(0)
    kv_heads, block, d, h = 2, 16, 64, 6
    k_pool, v_pool = (torch.randn(10 * kv_heads * block + 1, d) for _ in range(2))  # (N * K * BS + 1, D)
    tables = torch.tensor([[3, 1, 7, 0], [2, 0, 0, 0], [9, 8, 6, 5]])  # (B, M)
    lengths = torch.tensor([40, 5, 64])  # (B,)
    q = torch.randn(3, h, d)  # (B, H, D)
    op = torch.ops.ts_panels.paged_decode
    together = op(q, k_pool, v_pool, tables, lengths, kv_heads, block, 0.125)  # (B, H, D)
    for row in range(3):
        alone = op(q[row:row + 1].contiguous(), k_pool, v_pool, tables[row:row + 1].contiguous(),
                   lengths[row:row + 1], kv_heads, block, 0.125)  # (1, H, D)
        assert torch.equal(together[row], alone[0])
        pool_k = k_pool[:-1].view(10, kv_heads, block, d)[tables[row]].transpose(0, 1).reshape(kv_heads, -1, d)
        pool_v = v_pool[:-1].view(10, kv_heads, block, d)[tables[row]].transpose(0, 1).reshape(kv_heads, -1, d)
        n = int(lengths[row])
        keys = pool_k[:, :n].repeat_interleave(h // kv_heads, 0)  # (H, n, D)
        values = pool_v[:, :n].repeat_interleave(h // kv_heads, 0)  # (H, n, D)
        want = torch.softmax(q[row, :, None] @ keys.transpose(1, 2) * 0.125, -1) @ values  # (H, 1, D)
        torch.testing.assert_close(together[row], want[:, 0], rtol=1e-5, atol=1e-5)


@needs_kernels
@needs_kernels
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("others", [0, 5])
def test_a_rows_entries_get_the_bits_of_each_alone(d: int, dtype: torch.dtype, others: int) -> None:
    """A row's several entries at consecutive positions (drafted tokens verified in one step) read its
    keys once for all of them: each entry's output is the same bits as alone, beside `others` rows
    (few items: one query head an item; many: a key/value head's query heads together)."""
    torch.manual_seed(0)
    kv_heads, block, h = 2, 16, 6
    k_pool, v_pool = (torch.randn(40 * kv_heads * block + 1, d).to(dtype) for _ in range(2))  # (N * K * BS + 1, D)
    row = [3, 1, 7, 0]
    tables = torch.tensor([row] * 5 + [[i + 10, i + 20, 0, 0] for i in range(others)])  # (B, M)
    lengths = torch.tensor([37, 38, 39, 40, 41] + [17 + i for i in range(others)])  # (B,)
    q = torch.randn(len(tables), h, d)  # (B, H, D)
    op = torch.ops.ts_panels.paged_decode
    together = op(q, k_pool, v_pool, tables, lengths, kv_heads, block, 0.125)  # (B, H, D)
    for b in range(len(tables)):
        alone = op(q[b:b + 1].contiguous(), k_pool, v_pool, tables[b:b + 1].contiguous(), lengths[b:b + 1],
                   kv_heads, block, 0.125)  # (1, H, D)
        assert torch.equal(together[b], alone[0]), b
    keys = k_pool[:-1].float().view(40, kv_heads, block, d)[row].transpose(0, 1).reshape(kv_heads, -1, d)
    values = v_pool[:-1].float().view(40, kv_heads, block, d)[row].transpose(0, 1).reshape(kv_heads, -1, d)
    for b in range(5):
        n = int(lengths[b])
        scores = q[b, :, None] @ keys[:, :n].repeat_interleave(h // kv_heads, 0).transpose(1, 2) * 0.125  # (H, 1, n)
        want = torch.softmax(scores, -1) @ values[:, :n].repeat_interleave(h // kv_heads, 0)  # (H, 1, D)
        torch.testing.assert_close(together[b], want[:, 0], rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_a_table_outside_the_pool() -> None:
    pool = torch.zeros(2 * 1 * 4 + 1, 16)
    with pytest.raises(RuntimeError, match="names block 5 outside the pool"):
        torch.ops.ts_panels.paged_decode(torch.zeros(1, 1, 16), pool, pool, torch.tensor([[5]]),
                                             torch.tensor([3]), 1, 4, 1.0)


def test_a_reorder_shares_blocks_and_copies_a_shared_partial_block_on_write() -> None:
    """Beam search: rows 0..2 become rows [1, 1, 0]. Tables are copied (no keys move); rows 0 and 1 now
    share row 1's blocks, and since their last block is partly filled, one of them gets its own copy."""
    cache = small(blocks=12)
    for row, n in ((0, 6), (1, 7), (2, 3)):
        cache.ensure(row, n)
        cache.set_lengths(n, row, row + 1)
        for i, b in enumerate(cache.host_tables[row]):
            for t in cache.block_kv(b):
                t.fill_(10 * row + i)
    full, last = cache.host_tables[1]
    cache.reorder([1, 1, 0])
    assert cache.host_lengths[:3] == [7, 7, 6]
    t0, t1, t2 = cache.host_tables[:3]
    assert t0[0] == t1[0] == full and cache.refs(full) == 2  # the full block shared
    assert {t0[1], t1[1]} & {last} and t0[1] != t1[1]  # the partial one: the original and a copy
    assert all(t.eq(11).all() for t in cache.block_kv(t0[1]) + cache.block_kv(t1[1]))
    assert all(t.eq(1).all() for t in cache.block_kv(t2[1]))  # row 2 holds what row 0 held
    assert cache.tables[:3, :2].tolist() == [t0, t1, t2]
    cache.reset()
    assert cache.blocks_free == cache.blocks_total  # every reference given back


@needs_kernels
def test_beam_search_on_the_paged_cache_equals_the_dense_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """translate_ids with mixed beams: the paged cache (decode kernel, shared blocks) and the dense one
    give the same translations."""
    from models import beam_search
    from models.beam_search import BeamParams, translate_ids

    model, _ = tiny_model("seq2seq")
    sources = [[5, 9, 12, 7, 0], [30, 31, 0], [44, 8, 19, 23, 61, 7, 3, 0]]
    params = [BeamParams(4, 12), BeamParams(1, 9), BeamParams(3, 12)]
    paged = translate_ids(model, sources, params)
    monkeypatch.setattr(beam_search, "kernel_runs", lambda dtype, device: False)
    dense = translate_ids(model, sources, params)
    assert paged == dense and len({tuple(p) for p in paged}) == 3


@needs_kernels
@pytest.mark.parametrize("kernel", [True, False])
def test_a_beam_search_never_reads_what_its_rows_did_not_write(kernel: bool) -> None:
    """BeamSearch's pool starts uninitialised (zeroed=False; blocks are zeroed as rows take them):
    filled with NaN past the null block before the search, the translations are those of a zeroed
    pool, through the decode kernel and through the gathered path (which reads whole blocks, masked)."""
    from models.beam_search import BeamParams, BeamSearch, translate_ids

    model, _ = tiny_model("seq2seq")
    sources = [[5, 9, 12, 7, 0], [30, 31, 0], [44, 8, 19, 23, 61, 7, 3, 0]]
    params = [BeamParams(4, 12), BeamParams(1, 9), BeamParams(3, 12)]
    search = BeamSearch(model, 8, 12)
    cache = search.cache
    assert isinstance(cache, PagedKVCache)
    cache.decode_kernel = kernel
    null = cache.kv_heads * cache.block
    cache._pool[:, :, null:cache.trash] = float("nan")  # every block rows may be given
    search.add(sources, params, keys=range(3))
    out: list = [None] * 3
    while search:
        for event in search.step():
            if event.done:
                out[event.key] = event.ids
    assert out == translate_ids(model, sources, params)
    assert all(not t.isnan().any() for t in cache.block_kv(0))  # the null block stays zero


# the native step always attends through the decode kernel
@pytest.mark.parametrize(("backend", "kernel"), [("torch", False), ("torch", True), ("native", True)])
def test_a_token_view_step_equals_one_step_per_token(backend: str, kernel: bool) -> None:
    """A row's next tokens as entries of one step (view_tokens: speculative decoding's verify step)
    give the logits of decoding them one step at a time: bitwise on the native step (every entry is a
    decode row of its own), and the row's length is left for the caller to advance."""
    if (kernel or backend == "native") and not native.available() and not os.environ.get("REQUIRE_NATIVE_KERNELS"):
        pytest.skip("no AVX2 or AVX-512 CPU, or no compiler, for the native kernels")
    from models.execution.planner import Runtime, plan_model
    from tests.models.execution.test_native import fast_model

    model = fast_model("q4_1")
    steps = plan_model(model, {"decode": backend, "prefill": "torch"}, Runtime(paged=True, graphs=False))
    prompts, n = [PROMPTS[0], PROMPTS[1]], 14  # across block boundaries (blocks of 16)
    caches = [PagedKVCache.for_model(model.cfg, rows=2, blocks=20, max_len=64, decode_kernel=kernel) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            ids = torch.tensor([p + [0] * (len(prompts[0]) - len(p)) for p in prompts])  # (B, T) right-padded
            steps.prefill(ids, cache.view(), torch.tensor([len(p) - 1 for p in prompts]))
            cache.advance([len(p) for p in prompts])
        plain, tokens = [], [[5], [6]]
        for _ in range(n):  # one token a row a step
            logits = steps.decode(torch.tensor([[t[-1]] for t in tokens]), caches[0].view())[:, 0]  # (B, V)
            caches[0].advance(1)
            plain.append(logits)
            for row in range(2):
                tokens[row].append(int(logits[row].argmax()))
        # row 0: its n tokens as n entries of one step; row 1: 3 entries, then the rest in a second step
        base = list(caches[1].host_lengths[:2])
        rows = [0] * n + [1] * 3
        past = [base[0] + j for j in range(n)] + [base[1] + j for j in range(3)]
        ids = torch.tensor([[t] for t in tokens[0][:n] + tokens[1][:3]])  # (E, 1)
        first = steps.decode(ids, caches[1].view_tokens(rows, past))[:, 0]  # (E, V)
        assert caches[1].host_lengths[:2] == base
        caches[1].advance([0, 3])
        rest = steps.decode(torch.tensor([[t] for t in tokens[1][3:n]]),
                            caches[1].view_tokens([1] * (n - 3), [base[1] + j for j in range(3, n)]))[:, 0]
    want = torch.stack([plain[j][0] for j in range(n)] + [plain[j][1] for j in range(n)])  # (2n, V)
    got = torch.cat([first[:n], first[n:], rest])
    if backend == "native":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_the_kernel_reads_a_bfloat16_pool_as_its_values_widened() -> None:
    """A bfloat16 pool through the decode kernel gives the bits the same pool widened to float32 gives
    (each value widened exactly, the same order of sums), at the fixed head dims and the general one."""
    torch.manual_seed(1)
    kv_heads, block, h = 2, 16, 6
    tables = torch.tensor([[3, 1, 7, 0], [2, 0, 0, 0], [9, 8, 6, 5]])  # (B, M)
    lengths = torch.tensor([40, 5, 64])  # (B,)
    op = torch.ops.ts_panels.paged_decode
    for d in (64, 48):
        k_pool, v_pool = (torch.randn(10 * kv_heads * block + 1, d).bfloat16() for _ in range(2))  # (N * K * BS + 1, D)
        q = torch.randn(3, h, d)  # (B, H, D)
        narrow = op(q, k_pool, v_pool, tables, lengths, kv_heads, block, 0.125)
        wide = op(q, k_pool.float(), v_pool.float(), tables, lengths, kv_heads, block, 0.125)
        assert narrow.dtype == torch.float32 and torch.equal(narrow, wide)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        op(q, k_pool, v_pool.float(), tables, lengths, kv_heads, block, 0.125)


@pytest.mark.parametrize("kernel", [False, True])
def test_a_bfloat16_pool_equals_its_values_and_stays_close_to_float32(kernel: bool) -> None:
    """A bfloat16 pool stores each key and value rounded (as torch's conversion) and every step, prompt
    or decode, attends the stored values: the decode kernel and the gathered path agree on it, and its
    logits stay within bfloat16's rounding of the float32 pool's."""
    if kernel and not native.available() and not os.environ.get("REQUIRE_NATIVE_KERNELS"):
        pytest.skip("no AVX2 or AVX-512 CPU, or no compiler, for the native kernels")
    model = gqa_model()
    wide = run(model, PagedKVCache.for_model(model.cfg, rows=3, blocks=20, max_len=64, decode_kernel=kernel),
               PROMPTS, 20)
    narrow_cache = PagedKVCache.for_model(model.cfg, rows=3, blocks=20, max_len=64, dtype=torch.bfloat16,
                                          decode_kernel=kernel)
    narrow = run(model, narrow_cache, PROMPTS, 20)
    gathered = run(model, PagedKVCache.for_model(model.cfg, rows=3, blocks=20, max_len=64, dtype=torch.bfloat16,
                                                 decode_kernel=False), PROMPTS, 20)
    assert narrow_cache._pool.dtype == torch.bfloat16
    for step, (n, g) in enumerate(zip(narrow, gathered, strict=True)):
        torch.testing.assert_close(n, g, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    # close while both pools decode the same tokens (each run feeds its own greedy tokens back)
    same = next((i for i, (w, n) in enumerate(zip(wide, narrow, strict=True)) if not torch.equal(w.argmax(-1), n.argmax(-1))),
                len(wide))
    assert same >= 5
    for step in range(same):
        torch.testing.assert_close(narrow[step], wide[step], rtol=0, atol=5e-2, msg=f"step {step}")
    assert not torch.equal(narrow[0], wide[0])  # the pool is narrower


def test_a_prompt_in_chunks_on_a_bfloat16_pool_equals_it_whole() -> None:
    """Chunks attend the earlier chunks' stored (rounded) keys, and so does a whole prompt: the same
    logits either way."""
    model = gqa_model()
    prompt = PROMPTS[0]
    logits = []
    for chunks in ([prompt], [prompt[:7], prompt[7:16], prompt[16:]]):
        cache = PagedKVCache.for_model(model.cfg, rows=1, blocks=8, max_len=64, dtype=torch.bfloat16,
                                       decode_kernel=False)
        with torch.inference_mode():
            for chunk in chunks:
                out = model(torch.tensor([chunk]), cache=cache.view(), last=torch.tensor([len(chunk) - 1]))[:, 0]
                cache.advance(len(chunk))
        logits.append(out)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
