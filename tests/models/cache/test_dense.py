"""KVCache (per-row positions, packing, beam reordering, views), CrossCache and CrossSlots.

Dimension legend: R cache rows, B rows of a view, K kv heads, L slots per row, T new tokens,
S key length of a step, D head dim. Keys are filled with recognisable values so every test
checks exactly which slot holds what.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from models.attention import AttentionMask, causal_mask, padding_mask
from models.cache.cross import CrossCache, CrossSlots
from models.cache.dense import UNWRITTEN, KVCache
from models.config import PRESETS

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread is fastest


LAYERS, ROWS, K, L, D = 2, 4, 2, 8, 3


def make_cache() -> KVCache:
    return KVCache(LAYERS, ROWS, K, L, D)


def tokens(b: int, t: int, base: float) -> tuple[Tensor, Tensor]:
    """Keys (B, K, T, D) whose value encodes (row, token): base + 10 * row + token; values = -keys."""
    k = base + 10 * torch.arange(b)[:, None, None, None] + torch.arange(t)[None, None, :, None]  # (B, 1, T, 1)
    k = k.float().expand(b, K, t, D).clone()  # (B, K, T, D)
    return k, -k


def slot_ids(cache: KVCache, layer: int = 0) -> Tensor:
    """The encoded value at every (row, slot) of head 0: (R, L)."""
    return cache.k[layer][:, 0, :, 0]


def test_buffers_are_preallocated() -> None:
    cache = make_cache()
    assert len(cache.k) == len(cache.v) == LAYERS
    assert cache.k[0].shape == (ROWS, K, L, D) and cache.lengths.shape == (ROWS,)
    assert cache.nbytes() == 2 * LAYERS * ROWS * K * L * D * 4


def test_for_model_uses_the_decoder_stack() -> None:
    cfg = PRESETS["tiny-seq2seq"].replace(n_layers=3, decoder_layers=1)
    cache = KVCache.for_model(cfg, rows=2, max_len=5)
    assert len(cache.k) == 1 and cache.k[0].shape == (2, cfg.kv_heads, 5, cfg.head_dim)
    llama = KVCache.for_model(PRESETS["tiny-llama"], rows=1)
    assert llama.k[0].shape == (1, 2, PRESETS["tiny-llama"].max_positions, 4)


def test_write_at_per_row_positions_and_advance() -> None:
    cache = make_cache()
    cache.set_lengths([0, 2, 5, 1])
    view = cache.view()
    positions, s = view.begin(2)
    assert torch.equal(positions, torch.tensor([[0, 1], [2, 3], [5, 6], [1, 2]]))
    assert s == 7  # longest past (5) + 2 new
    k, v = tokens(ROWS, 2, base=100)
    k_all, v_all = view.write(0, k, v)
    assert k_all.shape == v_all.shape == (ROWS, K, s, D)
    for row, start in enumerate([0, 2, 5, 1]):
        got = slot_ids(cache)[row, start:start + 2]
        assert torch.equal(got, torch.tensor([100.0, 101.0]) + 10 * row)
        assert torch.equal(cache.v[0][row, 0, start:start + 2, 0], -got)
    assert cache.k[1].abs().sum() == 0  # other layers untouched
    assert torch.equal(cache.lengths, torch.tensor([0, 2, 5, 1]))  # the caller advances
    cache.advance(torch.tensor([2, 1, 2, 0]))  # right-padded rows advance by their real tokens only
    assert torch.equal(cache.lengths, torch.tensor([2, 3, 7, 1]))
    cache.advance(1, start=1, stop=3)
    assert torch.equal(cache.lengths, torch.tensor([2, 4, 8, 1]))
    cache.reset(2)
    assert torch.equal(cache.lengths, torch.tensor([2, 4, 0, 0]))


def test_write_returns_views_of_the_buffer() -> None:
    cache = make_cache()
    view = cache.view()
    view.begin(1)
    k_all, _ = view.write(0, *tokens(ROWS, 1, base=1))
    assert k_all.untyped_storage().data_ptr() == cache.k[0].untyped_storage().data_ptr()


def test_view_slices_rows() -> None:
    cache = make_cache()
    cache.set_lengths([1, 3, 2, 4])
    view = cache.view(1, 3)
    assert torch.equal(view.lengths, torch.tensor([3, 2]))
    positions, s = view.begin(1)
    assert torch.equal(positions, torch.tensor([[3], [2]])) and s == 4
    k, v = tokens(2, 1, base=50)
    k_all, _ = view.write(1, k, v)
    assert k_all.shape == (2, K, 4, D)
    assert cache.k[1][1, 0, 3, 0] == 50 and cache.k[1][2, 0, 2, 0] == 60
    assert cache.k[1][0].abs().sum() == 0 and cache.k[1][3].abs().sum() == 0  # rows outside the view
    view.cache.advance(1, view.start, view.stop)
    assert torch.equal(cache.lengths, torch.tensor([1, 4, 3, 4]))


def test_capacity_error_names_the_sizes() -> None:
    cache = make_cache()
    cache.set_lengths([0, 6, 0, 0])
    with pytest.raises(ValueError, match=f"KV cache holds {L} tokens per row; this step needs 9"):
        cache.view().begin(3)
    with pytest.raises(ValueError, match="this step needs 9"):
        cache.view().write(0, *tokens(ROWS, 3, base=0))
    cache.view(2, 4).begin(3)  # rows with room are fine
    positions, s = cache.view().begin(2)
    assert s == L  # exactly full is allowed


def _filled() -> KVCache:
    """Rows of lengths 3, 1, 4, 2 whose slot values are 10 * row + slot + 1 (zeros beyond)."""
    cache = make_cache()
    lengths = torch.tensor([3, 1, 4, 2])
    view = cache.view()
    view.begin(4)
    for layer in range(LAYERS):
        view.write(layer, *tokens(ROWS, 4, base=1 + 100 * layer))
    slots = torch.arange(L)[None, :]  # (1, L)
    for buf in cache.k + cache.v:
        buf.masked_fill_((slots >= lengths[:, None])[:, None, :, None], 0.0)  # only real tokens stay
    cache.advance(lengths)
    return cache


def test_move_row_copies_keys_values_and_length() -> None:
    cache = _filled()
    before = slot_ids(cache).clone()
    cache.move_row(2, 0)  # pack: row 2 takes the slot of finished row 0
    assert cache.lengths[0] == 4 and cache.lengths[2] == 4
    assert torch.equal(slot_ids(cache)[0, :4], before[2, :4])
    assert torch.equal(cache.k[1][0], cache.k[1][2]) and torch.equal(cache.v[1][0], cache.v[1][2])
    assert torch.equal(slot_ids(cache)[2], before[2])  # the source keeps its data
    cache.move_row(1, 1)
    assert torch.equal(slot_ids(cache)[1], before[1])


def test_reorder_gathers_rows_for_beams() -> None:
    cache = _filled()
    before = [buf.clone() for buf in cache.k + cache.v]
    lengths = cache.lengths.clone()
    index = torch.tensor([2, 2, 0, 1])  # beam 2 survives twice; beam 3 dies
    cache.reorder(index)
    assert torch.equal(cache.lengths, lengths[index])
    for buf, old in zip(cache.k + cache.v, before, strict=True):
        for row, src in enumerate(index.tolist()):
            n = int(lengths[src])
            assert torch.equal(buf[row, :, :n], old[src, :, :n]), (row, src)


def test_reorder_with_offset_leaves_other_rows() -> None:
    """Rows [start, start + n) are one request's beams; rows before start belong to others."""
    cache = _filled()
    before = slot_ids(cache).clone()
    lengths = cache.lengths.clone()
    cache.reorder(torch.tensor([2, 0]), start=1)  # rows 1, 2 become old rows 3, 1
    assert torch.equal(cache.lengths, lengths[[0, 3, 1, 3]])
    assert torch.equal(slot_ids(cache)[1, :2], before[3, :2])
    assert torch.equal(slot_ids(cache)[2, :1], before[1, :1])
    assert torch.equal(slot_ids(cache)[0], before[0]) and torch.equal(slot_ids(cache)[3], before[3])


def test_reorder_copies_longer_source_rows_whole() -> None:
    """A short row replaced by a longer one gets all of the longer row's slots."""
    cache = _filled()
    before = slot_ids(cache).clone()
    cache.reorder(torch.tensor([2, 2]), start=0)  # row 0 (3 tokens) and row 1 (1 token) <- row 2 (4)
    assert torch.equal(slot_ids(cache)[0, :4], before[2, :4])
    assert torch.equal(slot_ids(cache)[1, :4], before[2, :4])


def test_reorder_in_length_groups_reads_every_row_before_writing() -> None:
    """Moved rows are copied in groups of similar length; a row one group writes may be a row another
    group reads (a source leaving shifts the others): each row still gets its source's old keys."""
    cache = KVCache(LAYERS, 4, K, 40, D)
    lengths = [30, 5, 20, 3]  # groups of 32, 16, 32 and 16 tokens
    for buf in cache.k + cache.v:
        buf.copy_(torch.randn_like(buf))
    cache.set_lengths(lengths)
    before = [buf.clone() for buf in cache.k + cache.v]
    index = [1, 2, 0, 3]  # row 0 <- 1 (16-token group) while row 2 <- 0 (32-token group)
    cache.reorder(index)
    assert cache.host_lengths == [lengths[i] for i in index] and cache.lengths.tolist() == cache.host_lengths
    for buf, old in zip(cache.k + cache.v, before, strict=True):
        for row, src in enumerate(index):
            assert torch.equal(buf[row, :, :lengths[src]], old[src, :, :lengths[src]]), (row, src)


def test_cross_cache_select() -> None:
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(3, K, 5, D, generator=g), torch.randn(3, K, 5, D, generator=g)) for _ in range(LAYERS)]
    src_keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    cross = CrossCache(kv, src_keep)
    index = torch.tensor([1, 1, 1, 2])  # three beams of source 1, one of source 2; source 0 finished
    picked = cross.select(index)
    assert len(picked.kv) == LAYERS
    assert torch.equal(picked.src_keep, src_keep[index])
    for (k, v), (k0, v0) in zip(picked.kv, kv, strict=True):
        assert k.shape == v.shape == (4, K, 5, D)
        assert torch.equal(k, k0[index]) and torch.equal(v, v0[index])
    assert torch.equal(cross.src_keep, src_keep)  # the original is unchanged


def sources(lengths: list[int], base: float) -> CrossCache:
    """Cross keys/values of len(lengths) right-padded sources, key (source i, position s) = base + 10 i
    + s in every layer (values = -keys)."""
    s = max(lengths)
    k = base + 10 * torch.arange(len(lengths))[:, None, None, None] + torch.arange(s)[None, None, :, None]
    k = k.float().expand(len(lengths), K, s, D).clone()  # (B, K, S, D)
    keep = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
    return CrossCache.build([(k, -k)] * LAYERS, keep)


def test_cross_slots_keep_every_source_in_place_as_others_join_and_leave() -> None:
    """A join writes only its own slots and a leave frees its slot for the next join; every other
    source's keys, values and key count stay where they were, also when the store grows (more slots,
    a longer source)."""
    store = CrossSlots(limit=5)
    a = store.put(sources([3, 2], 100.0))
    assert a == [0, 1] and store.capacity == 2
    b = store.put(sources([1], 200.0))  # grows to 4 slots
    assert b == [2] and store.capacity == 4
    store.release([a[0]])
    c = store.put(sources([20, 4], 300.0))  # the freed slot first; S grows past 16 (to 32)
    assert c == [0, 3] and store.capacity == 4
    with pytest.raises(ValueError, match="do not fit"):
        store.put(sources([1, 1], 0.0))  # 4 used + 2 > limit 5
    cache = store.cache
    held = {a[1]: (100.0 + 10, 2), b[0]: (200.0, 1), c[0]: (300.0, 20), c[1]: (300.0 + 10, 4)}
    assert cache.src_keep.shape[1] == 32 and all(k.shape == (4, K, 32, D) for k, _ in cache.kv)
    for slot, (base, n) in held.items():
        assert cache.src_keep[slot].tolist() == [True] * n + [False] * (32 - n), slot
        for k, v in cache.kv:
            want = base + torch.arange(n).float()
            assert torch.equal(k[slot, 1, :n, 0], want) and torch.equal(v[slot, 1, :n, 0], -want), slot
    store.release([b[0]])
    assert not store.cache.src_keep[b[0]].any()  # a free slot is no source's
    grouped = store.cache.grouped(torch.tensor([0, 1, 3 * 4]), width=4)  # beams 0, 1 of slot 0; slot 3
    rows, counts = grouped.row_sources()
    assert rows.view(-1).tolist() == [0, 0, 3] and counts.tolist() == [20, 20, 4]
    store.release([c[1]])  # the highest slot in use is now 1: the cache covers slots 0 and 1 only
    assert store.cache.src_keep.shape == (2, 32) and all(k.size(0) == 2 for k, _ in store.cache.kv)
    assert store.cache.src_keep[0].sum() == 20 and store.cache.src_keep[1].sum() == 2


# --- sliding window: a ring of W slots per row ------------------------------------------------------

W = 3


def ring_cache(rows: int = 2, max_len: int = 12) -> KVCache:
    return KVCache(1, rows, K, max_len, D, window=W)


def test_a_window_shorter_than_the_row_makes_a_ring_of_w_slots() -> None:
    ring = ring_cache()
    assert ring.ring and ring.slots == W and ring.k[0].shape == (2, K, W, D)
    assert ring.nbytes() == 2 * 2 * K * W * D * 4  # the window's bytes, not max_len's
    wide = KVCache(1, 2, K, 3, D, window=5)  # a window longer than the row changes nothing
    assert not wide.ring and wide.slots == 3
    llama = KVCache.for_model(PRESETS["tiny-llama"].replace(sliding_window=4), rows=1, max_len=10)
    assert llama.ring and llama.slots == 4


def test_a_prefill_stores_each_rows_last_w_real_tokens_and_attends_its_own() -> None:
    ring = ring_cache()
    keep = torch.tensor([[True] * 5, [True, True, False, False, False]])  # rows of 5 and 2 real tokens
    view = ring.view()
    positions, s = view.begin(5, keep)
    assert s == 5 and torch.equal(view.key_positions(), positions)  # no past: its own keys only
    k, v = tokens(2, 5, base=100)  # token t of row r: 100 + 10 r + t
    k_all, _ = view.write(0, k, v)
    assert torch.equal(k_all, k)  # attends its own 5 keys (the ring keeps only 3)
    # row 0: positions 2, 3, 4 in slots 2, 0, 1; row 1: its 2 real tokens, its padding in the trash
    assert torch.equal(slot_ids(ring)[0], torch.tensor([103.0, 104.0, 102.0]))
    assert torch.equal(slot_ids(ring)[1, :2], torch.tensor([110.0, 111.0])) and slot_ids(ring)[1, 2] == 0
    ring.advance(keep.sum(-1))
    assert ring.held() == [3, 2]


def test_one_token_steps_overwrite_the_key_that_left_the_window() -> None:
    ring = ring_cache()
    ring.set_lengths([5, 1])
    view = ring.view()
    positions, s = view.begin(1)
    assert torch.equal(positions, torch.tensor([[5], [1]])) and s == W
    # row 0 (token at 5): slots hold 3, 4, 5; row 1 (token at 1): 0, 1 and nothing yet
    assert torch.equal(view.key_positions(), torch.tensor([[3, 4, 5], [0, 1, UNWRITTEN]]))
    view.write(0, *tokens(2, 1, base=200))
    assert slot_ids(ring)[0, 5 % W] == 200 and slot_ids(ring)[1, 1] == 210
    mask = causal_mask(positions, view.key_positions(), W)  # (B, 1, 1, S)
    assert mask[:, 0, 0].tolist() == [[True, True, True], [True, True, False]]


def test_several_tokens_after_a_past_read_the_ring_before_writing() -> None:
    """A step of T > 1 tokens on rows with a past: its queries see the past slots as they were, then
    its own keys (a write first would have overwritten keys its first queries still see)."""
    ring = ring_cache(rows=1)
    view = ring.view()
    view.begin(4)
    view.write(0, *tokens(1, 4, base=100))  # positions 0..3: slots hold 3, 1, 2
    ring.advance(4)
    view = ring.view()
    positions, s = view.begin(2)
    assert s == W + 2 and torch.equal(positions, torch.tensor([[4, 5]]))
    assert torch.equal(view.key_positions(), torch.tensor([[3, 1, 2, 4, 5]]))
    k_all, _ = view.write(0, *tokens(1, 2, base=300))
    assert k_all[0, 0, :, 0].tolist() == [103.0, 101.0, 102.0, 300.0, 301.0]
    assert slot_ids(ring)[0].tolist() == [103.0, 300.0, 301.0]  # now positions 3, 4, 5
    mask = causal_mask(positions, view.key_positions(), W)  # (1, 1, 2, 5)
    # position 4 sees 2, 3, 4; position 5 sees 3, 4, 5
    assert mask[0, 0].tolist() == [[True, False, True, True, False], [True, False, False, True, True]]


def test_a_ring_moves_and_reorders_its_w_slots() -> None:
    ring = ring_cache(rows=3)
    view = ring.view(0, 1)
    view.begin(5)
    view.write(0, *tokens(1, 5, base=100))
    ring.advance(5, 0, 1)
    ring.move_row(0, 2)
    assert ring.lengths[2] == 5 and torch.equal(slot_ids(ring)[2], slot_ids(ring)[0])
    ring.reorder(torch.tensor([2, 2]), start=0)
    assert torch.equal(slot_ids(ring)[1], slot_ids(ring)[2]) and ring.lengths[1] == 5


# --- no device reads inside a step -----------------------------------------------------------------


def test_host_lengths_follow_every_change() -> None:
    cache = KVCache(LAYERS, ROWS, K, L, D)
    cache.advance(torch.tensor([2, 1, 3, 0]))
    cache.advance(1, start=1, stop=3)
    cache.advance([1, 0], start=2)
    cache.move_row(2, 0)
    cache.reorder(torch.tensor([1, 1]), start=2)
    cache.reset(3)
    cache.set_lengths(5, 3, 4)
    assert cache.host_lengths == cache.lengths.tolist() == [5, 2, 0, 5]


@pytest.mark.parametrize("family", ["decoder", "windowed", "seq2seq", "paged"])
def test_a_decode_step_reads_nothing_from_the_device(family: str) -> None:
    """On the meta device a tensor has no value: any read of one on the host (int(), bool(), .item(),
    .tolist()) raises, so a step that runs there never waits for the device (issue: a GPU step must
    not synchronise). Rows at different lengths; the ring after it has wrapped."""
    from models.tiny import tiny_model

    model, _ = tiny_model("seq2seq" if family == "seq2seq" else "decoder")
    if family == "windowed":
        from models.decoder import DecoderLM

        model = DecoderLM(model.cfg.replace(sliding_window=3)).eval()
    model = model.to("meta")
    cache = KVCache.for_model(model.cfg, rows=3, max_len=16, device="meta")
    if family == "paged":  # rows over 1 and 2 blocks of 4 (the step needs a new block for row 0)
        from models.cache.paged import PagedKVCache

        cache = PagedKVCache(model.cfg.n_layers, 3, model.cfg.kv_heads, 16, model.cfg.head_dim, blocks=10,
                             device="meta", block=4)
        for row, n in enumerate([4, 2, 7]):
            cache.ensure(row, n)
        cache.set_lengths([4, 2, 7])
    else:
        cache.set_lengths([5, 2, 7])
    assert cache.ring == (family == "windowed")
    ids = torch.zeros(3, 1, dtype=torch.long, device="meta")  # (B, 1)
    with torch.inference_mode():
        if family == "seq2seq":
            heads, d = model.cfg.kv_heads, model.cfg.head_dim
            kv = [(torch.zeros(3, heads, 4, d, device="meta"),) * 2 for _ in model.decoder.blocks]
            keep = torch.ones(3, 4, dtype=torch.bool, device="meta")
            cross = CrossCache(kv, keep, AttentionMask(padding_mask(keep), None))  # as CrossCache.build makes it
            logits = model.decode(ids, cross.select(torch.tensor([2, 0, 1], device="meta")), cache=cache.view())
        else:
            logits = model(ids, cache=cache.view())
        cache.advance(1)
    assert logits.shape == (3, 1, model.cfg.vocab_size) and logits.device.type == "meta"
    assert cache.host_lengths == ([5, 3, 8] if family == "paged" else [6, 3, 8])
