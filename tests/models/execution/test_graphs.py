"""Decode steps padded to buckets over static buffers (models/execution/graphs.py): on CUDA they are
captured graphs; here they run eagerly, so what is checked is what the graphs replay: the padded
rows, the packed inputs and the bucket choice give every real row the logits of a plain step, and
padding rows write nothing but the trash slot."""

from __future__ import annotations

import pytest
import torch

from models.cache.paged import PagedKVCache
from models.decoder import DecoderLM
from models.execution.graphs import DecodeGraphs, FixedStep, bucket, buckets
from models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_buckets_double_up_to_the_limit() -> None:
    assert buckets(1) == (1,)
    assert buckets(12) == (1, 2, 4, 8, 12)
    assert buckets(16) == (1, 2, 4, 8, 16)
    assert [bucket(n, buckets(12)) for n in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]


def gqa_model() -> DecoderLM:
    """6 query heads on 2 kv heads, rotary: the shapes a GQA decoder's step pads."""
    model, _ = tiny_model("decoder")
    torch.manual_seed(0)
    return DecoderLM(model.cfg.replace(d_model=96, n_heads=6, n_kv_heads=2, d_ff=64, max_positions=128)).eval()


PROMPTS = [[3, 9, 4, 11, 2, 8, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42], [7, 7, 1, 2], [50]]


def prefilled(model: DecoderLM) -> PagedKVCache:
    """A cache of 5 rows (buckets 1, 2, 4, 5) with PROMPTS prefilled on rows 0-2."""
    cache = PagedKVCache.for_model(model.cfg, rows=5, blocks=40, max_len=96, decode_kernel=False)
    ids = torch.zeros(len(PROMPTS), max(map(len, PROMPTS)), dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, :len(p)] = torch.tensor(p)
    with torch.inference_mode():
        model(ids, cache=cache.view(0, 3), last=torch.tensor([len(p) - 1 for p in PROMPTS]))
    cache.advance([len(p) for p in PROMPTS], 0, 3)
    return cache


@pytest.mark.parametrize(("start", "stop"), [(0, 3), (1, 3), (2, 3)])
def test_a_padded_step_gives_each_row_the_logits_of_a_plain_step(start: int, stop: int) -> None:
    """24 steps (rows cross block boundaries, the key-block bucket grows from 2 to 4): rows [start,
    stop) padded to a row bucket give the plain step's logits, and the cache holds the same keys."""
    model = gqa_model()
    plain, padded = prefilled(model), prefilled(model)
    graphs = DecodeGraphs(model, padded, capture=False)
    tokens = [[5 + i] for i in range(start, stop)]
    used = set()
    with torch.inference_mode():
        for step in range(24):
            want = model(torch.tensor(tokens), cache=plain.view(start, stop))[:, 0]  # (B, V)
            got = graphs.step([t[0] for t in tokens], start, stop)  # (B, V)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}")
            plain.advance(1, start, stop)
            padded.advance(1, start, stop)
            tokens = [[int(t)] for t in want.argmax(-1)]
            used |= set(graphs._steps)
    assert padded.host_tables == plain.host_tables
    for row in range(start, stop):
        for block in plain.host_tables[row]:
            for a, b in zip(plain.block_kv(block), padded.block_kv(block), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    rows = bucket(stop - start, graphs.row_buckets)
    assert {r for r, _ in used} == {rows} and len({b for _, b in used}) >= 2, used


def test_padding_rows_write_only_the_trash_slot() -> None:
    """A bucket of 4 rows for one real row: the three padding rows' keys go to the trash slot; no
    block of the pool but the real row's new slot changes."""
    model = gqa_model()
    cache = prefilled(model)
    before = [buf.clone() for buf in cache._flat_k + cache._flat_v]
    step = FixedStep.build(cache, 4, 2)
    cache.ensure(1, cache.host_lengths[1] + 1)
    step.packed.copy_(step.host_inputs([9], [1]))
    with torch.inference_mode():
        model(step.ids, cache=step)
    n, bs, heads = cache.host_lengths[1], cache.block, cache.kv_heads
    table = cache.host_tables[1]
    written = {(table[n // bs] * heads + k) * bs + n % bs for k in range(heads)} | {cache.trash}
    for old, new in zip(before, cache._flat_k + cache._flat_v, strict=True):
        changed = set((old != new).any(-1).nonzero().flatten().tolist())
        assert changed <= written and changed - {cache.trash}, changed


def test_capture_all_builds_every_bucket_once() -> None:
    model = gqa_model()
    graphs = DecodeGraphs(model, prefilled(model), capture=False)
    assert graphs.capture_all() == len(graphs.row_buckets) * len(graphs.block_buckets) == 4 * 4
    assert graphs.capture_all() == 16
