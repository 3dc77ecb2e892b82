"""Adapters on every execution backend: the native step (float32 panels, q4_1 / q8_0 blocks, bfloat16
panels) and the compiled blocks give each row what the torch forward gives it, and a row's bits do not
depend on the adapters of the rows beside it.

    B rows, T tokens, V vocabulary
"""

from __future__ import annotations

import pytest
import torch

from models.adapters import ResidentAdapters, read_adapter
from models.adapters.peft import random_llama_factors, save_adapter
from models.cache.paged import PagedKVCache
from models.execution.planner import plan_model
from models.kernels import native
from tests.models.cache.test_paged import PROMPTS
from tests.models.execution.test_native import POST_NORM, encoded, fast_encoder, fast_model, run
from tests.models.projections.test_quant import needs_kernels

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), needs_kernels]
RANKS = (4, 8, 2)


def with_adapters(model, tmp_path, ranks=RANKS, capacity: int = 4, dtype=torch.float32,  # noqa: ANN001, ANN201
                  kernel: bool = False):
    """`model` with adapters of `ranks` loaded in slots 0.. (each on a subset of the projections)."""
    resident = ResidentAdapters([model], capacity=capacity, rank=max(ranks), dtype=dtype, kernel=kernel)
    subsets = [("q_proj", "v_proj", "o_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"), ("up_proj", "down_proj")]
    for i, r in enumerate(ranks):
        factors = random_llama_factors(model, r, seed=i, modules=subsets[i % 3])
        resident.load(read_adapter(save_adapter(tmp_path / f"a{i}", factors, r, 2 * r)))
    return resident


class Sloted:
    """An executor whose prefill and decode pass each row's adapter slot."""

    def __init__(self, executor, slots: torch.Tensor) -> None:  # noqa: ANN001
        self.executor, self.slots = executor, slots
        self.model = executor.model

    def prefill(self, ids, cache, last):  # noqa: ANN001, ANN201
        return self.executor.prefill(ids, cache, last, adapters=self.slots)

    def decode(self, ids, cache):  # noqa: ANN001, ANN201
        return self.executor.decode(ids, cache, adapters=self.slots)


def steps(model, backend: str, slots: torch.Tensor, prompts=PROMPTS) -> list[torch.Tensor]:  # noqa: ANN001
    executor = plan_model(model, {"decode": backend})
    assert executor.plan.backend("decode") == backend
    cache = PagedKVCache.for_model(model.cfg, rows=len(prompts), blocks=20, max_len=64)
    return run(Sloted(executor, slots), cache, prompts, 12)


@pytest.mark.parametrize(("weights", "changes", "factors"), [
    ("q4_1", {}, torch.float32), ("q4_1", {}, torch.bfloat16), ("q4_1", {}, torch.int8), ("f32", {}, torch.float32),
    ("q8_0", POST_NORM, torch.bfloat16)])
def test_the_native_step_gives_each_row_its_adapter_as_the_blocks_do(weights, changes, factors, tmp_path) -> None:
    model = fast_model(weights, **changes)
    with_adapters(model, tmp_path, dtype=factors)
    slots = torch.tensor([0, 1, -1, 2, 0][:len(PROMPTS)])  # (B,)
    blocks = steps(model, "torch", slots)
    fast = steps(model, "native", slots)
    plain = steps(model, "native", torch.full_like(slots, -1))
    atol = 1e-4 if weights != "f32" else 1e-5
    for step, (b, n) in enumerate(zip(blocks, fast, strict=True)):
        torch.testing.assert_close(n, b, rtol=1e-5, atol=atol, msg=f"step {step}")
    base_row = int((slots == -1).nonzero()[0])
    torch.testing.assert_close(fast[-1][base_row], plain[-1][base_row], rtol=0, atol=0)
    assert not torch.allclose(fast[-1][0], plain[-1][0], atol=1e-3)  # the adapters change their rows


def test_a_row_through_the_native_step_has_the_same_bits_whatever_adapters_are_beside_it(tmp_path) -> None:
    model = fast_model("q4_1")
    with_adapters(model, tmp_path)
    prompts = PROMPTS[:3]
    together = steps(model, "native", torch.tensor([1, 0, 2]), prompts)
    for row, slot in enumerate((1, 0, 2)):
        others = [(slot + 1) % 3 if r != row else slot for r in range(3)]
        apart = steps(model, "native", torch.tensor(others), prompts)
        for t, a in zip(together, apart, strict=True):
            assert torch.equal(t[row], a[row])


@pytest.mark.parametrize(("weights", "changes", "factors"), [
    ("q4_1", {}, torch.bfloat16), ("q4_1", {}, torch.int8), ("f32", {"d_ff": 40}, torch.float32)])
def test_a_row_alone_has_the_bits_it_has_among_other_adapter_rows(weights, changes, factors, tmp_path) -> None:
    """A step's one or two rows with adapters take their updates inside each projection's parallel region
    (lora.cpp's LoraAfter: each thread its outputs, the first products repeated), more rows in a region
    of their own: a row's bits are the same either way, on two threads whose outputs split a part (the
    query part of q/k/v; with d_ff 40, the up part where its vectors start off the thread's)."""
    model = fast_model(weights, **changes)
    with_adapters(model, tmp_path, dtype=factors)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        others = steps(model, "native", torch.tensor([1, 0, 2]))
        for row, slot in enumerate((1, 0, 2)):
            alone = steps(model, "native", torch.tensor([slot if r == row else -1 for r in range(3)]))
            for step, (o, a) in enumerate(zip(others, alone, strict=True)):
                assert torch.equal(o[row], a[row]), f"row {row}, step {step}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("slots", [[7, -1, -1], [0, 7, 1]])  # one row (inside the projection's region), three
def test_a_slot_outside_the_slots_is_an_error_not_a_stray_read(slots, tmp_path) -> None:
    model = fast_model("q4_1")
    with_adapters(model, tmp_path)  # 4 slots
    executor = plan_model(model, {"decode": "native"})
    cache = PagedKVCache.for_model(model.cfg, rows=3, blocks=20, max_len=64)
    with pytest.raises(RuntimeError, match="adapter slot 7 outside the 4 slots"):  # the step's own check
        run(_DecodeOnly(executor, torch.tensor(slots)), cache, PROMPTS, 2)


class _DecodeOnly(Sloted):
    """Sloted whose prefill has no adapters (the torch forward checks its own slots)."""

    def prefill(self, ids, cache, last):  # noqa: ANN001, ANN201
        return self.executor.prefill(ids, cache, last)


@pytest.mark.skipif(not native.has_bf16(), reason="bfloat16 panels need AVX512-BF16")
def test_adapters_beside_bfloat16_panels(tmp_path) -> None:
    from models.projections.dense import pack_dense
    from models.projections.fuse import fuse_projections
    from tests.models.cache.test_paged import gqa_model

    model = fuse_projections(gqa_model())
    pack_dense(model, "bf16")
    with_adapters(model, tmp_path)
    slots = torch.tensor([0, 1, -1, 2, 0][:len(PROMPTS)])
    # without adapters the two are the same bits; the updates' float32 sums differ in order (bmm against the
    # op's loops), and the next projection rounds its input to bfloat16, so a last-bit difference can move
    # an input by one bfloat16 step (2^-8 relative)
    for b, n in zip(steps(model, "torch", slots), steps(model, "native", slots), strict=True):
        torch.testing.assert_close(n, b, rtol=1e-2, atol=1e-2)
        assert torch.equal(n.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("left", [False, True])
def test_the_native_encoder_gives_each_sequence_its_adapter(left, tmp_path) -> None:
    model = fast_encoder()
    resident = ResidentAdapters([model], capacity=2, rank=4)
    factors = {}
    for name, (a, b) in random_llama_factors(model, 4, seed=3, modules=("q_proj", "up_proj", "down_proj")).items():
        layer = name.split(".")[2]
        hf = {"q_proj": "attention.self.query", "up_proj": "intermediate.dense", "down_proj": "output.dense"}[
            name.rsplit(".", 1)[-1]]
        factors[f"bert.encoder.layer.{layer}.{hf}"] = (a, b)
    resident.load(read_adapter(save_adapter(tmp_path / "enc", factors, 4, 8, "FEATURE_EXTRACTION")))
    rows = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    slots = torch.tensor([0, -1, 0])
    blocks, keep = encoded(model, rows, left, "torch", slots)
    fast, _ = encoded(model, rows, left, "native", slots)
    plain, _ = encoded(model, rows, left, "native")
    torch.testing.assert_close(fast[keep], blocks[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast[1][keep[1]], plain[1][keep[1]], rtol=0, atol=0)
    assert not torch.allclose(fast[0][keep[0]], plain[0][keep[0]], atol=1e-3)


@pytest.mark.parametrize("factors", [torch.bfloat16, torch.int8])
def test_rounded_factors_change_the_update_by_their_rounding_only(factors, tmp_path) -> None:
    """The same adapter with float32 and with bfloat16 or int8 factors (per-rank scales): the logits
    differ by the factors' rounding (well under the update itself), and the greedy tokens stay."""
    runs = {}
    for dtype in (torch.float32, factors):
        model = fast_model("f32")
        with_adapters(model, tmp_path / str(dtype), dtype=dtype)
        runs[dtype] = steps(model, "native", torch.tensor([1, 1, 1, 1, 1][:len(PROMPTS)]))
    plain = steps(fast_model("f32"), "native", torch.full((len(PROMPTS),), -1))
    for f32, rounded, base in zip(runs[torch.float32], runs[factors], plain, strict=True):
        update = (f32 - base).abs().max()
        assert (rounded - f32).abs().max() < 0.05 * update
        assert torch.equal(rounded.argmax(-1), f32.argmax(-1))


def test_int8_factors_are_rows_over_their_absolute_maximum() -> None:
    """put() rounds each rank row of a and of the scaled bt to int8 over its absolute maximum / 127 (a
    zero row keeps scale 0), and `scales` holds the two row scales multiplied."""
    from models.adapters.lora import LoraLinear

    lin = LoraLinear(torch.nn.Linear(6, 5, bias=False), (0, 5), capacity=2, rank=3, dtype=torch.int8)
    a = torch.tensor([[1.0, -2.2, 0.5, 0.0, 4.0, -1.0], [0.0] * 6])  # (2, I): rank 2, its second row zero
    b = torch.tensor([[0.5, 1.0], [-1.1, 0.0], [0.25, 0.0], [2.0, 0.0], [0.0, 0.0]])  # (O, 2)
    lin.put(1, 0, a, b, scale=2.0)
    assert lin.a.dtype == lin.bt.dtype == torch.int8 and int(lin.ranks[1, 0]) == 2
    assert lin.a[1, 0].tolist() == [32, -70, 16, 0, 127, -32] and lin.a[1, 1].abs().sum() == 0
    assert lin.bt[1, 0].tolist() == [32, -70, 16, 127, 0] and lin.bt[1, 1].tolist() == [127, 0, 0, 0, 0]
    expect = torch.tensor([(torch.tensor(4.0) / 127) * (torch.tensor(4.0) / 127), 0.0])
    torch.testing.assert_close(lin.scales[1, :2], expect, rtol=0, atol=0)
    assert lin.scales[0].abs().sum() == 0 and float(lin.scales[1, 2]) == 0
    lin.clear(1)
    assert lin.scales[1].abs().sum() == 0 and lin.a[1].abs().sum() == 0


@pytest.mark.parametrize(("weights", "factors"), [("f32", torch.float32), ("q4_1", torch.bfloat16),
                                                  ("q4_1", torch.int8)])
def test_our_update_kernel_in_the_torch_forward_equals_torchs_products(weights, factors, tmp_path) -> None:
    """Prompts and steps through the model's own forward: the updates by our kernel (kernel=True, as a
    CPU model serves) and by torch's batched products give each row the same logits."""
    slots = torch.tensor([0, 1, -1, 2, 0][:len(PROMPTS)])
    runs = []
    for kernel in (False, True):
        model = fast_model(weights)
        with_adapters(model, tmp_path / str(kernel), dtype=factors, kernel=kernel)
        runs.append(steps(model, "torch", slots))
    for b, k in zip(*runs, strict=True):
        torch.testing.assert_close(k, b, rtol=1e-5, atol=1e-4 if weights != "f32" else 1e-5)


def test_compiled_blocks_give_each_row_its_adapter_as_the_eager_blocks_do(tmp_path) -> None:
    """The compiled backend with adapters, as the shipped generator's prompts run (our update kernel inside
    the graphs): a prefill and decode steps of rows on different adapters and the base equal the eager
    blocks'."""
    from models.execution.compiled import compile_blocks
    from tests.models.execution.test_compiled import decode_steps

    models = []
    for compile_it in (False, True):
        model = fast_model("f32")
        with_adapters(model, tmp_path / f"{compile_it}", kernel=True)
        if compile_it:
            compile_blocks(model)
        models.append(model)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    slots = torch.tensor([0, -1, 2])
    eager, compiled = (decode_steps(_Slotted(m, slots), prompts, 3) for m in models)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


class _Slotted(torch.nn.Module):
    """A model called with fixed per-row adapter slots (decode_steps calls model(ids, cache=, last=))."""

    def __init__(self, model, slots: torch.Tensor) -> None:  # noqa: ANN001
        super().__init__()
        self.model, self.slots, self.cfg = model, slots, model.cfg

    def forward(self, ids: torch.Tensor, **kw: object) -> torch.Tensor:
        return self.model(ids, adapters=self.slots, **kw)


@pytest.mark.parametrize("factors", [torch.float32, torch.bfloat16, torch.int8])
def test_the_update_kernel_on_two_threads_gives_the_same_bits_as_on_one(factors) -> None:
    """A served model's shapes (a fused q/k/v of 576 + 2 x 192 outputs, rank 16): large enough that the
    kernel splits even one row's update over both threads (first products by ranks, then outputs by
    columns). Every row equals its own update in float64 within float32 rounding (int8 factors: times
    each rank's scale), and the bits are the same on one thread and on two, alone and beside rows of
    other slots."""
    gen = torch.Generator().manual_seed(0)
    slots_n, rank, width, parts = 3, 16, 576, (576, 192, 192)
    bounds = [0, 576, 768, 960]
    if factors == torch.int8:
        a = torch.randint(-127, 128, (slots_n, len(parts) * rank, width), generator=gen, dtype=torch.int8)
        bt = torch.randint(-127, 128, (slots_n, len(parts) * rank, bounds[-1]), generator=gen, dtype=torch.int8)
        scales = torch.rand(slots_n, len(parts) * rank, generator=gen) * 1e-5  # (N, P r)
    else:
        a = (torch.randn(slots_n, len(parts) * rank, width, generator=gen) * 0.05).to(factors)  # (N, P r, I)
        bt = (torch.randn(slots_n, len(parts) * rank, bounds[-1], generator=gen) * 0.05).to(factors)  # (N, P r, O)
        scales = None
    ranks = torch.tensor([[16, 16, 16], [8, 0, 16], [16, 4, 2]])  # (N, P): the ranks each slot uses
    x = torch.randn(7, width, generator=gen)  # (B, I)
    y = torch.randn(7, bounds[-1], generator=gen)  # (B, O)
    slots = torch.tensor([0, 2, -1, 0, 1, 0, 2])  # (B,)

    def op(x: torch.Tensor, y: torch.Tensor, *args: object) -> torch.Tensor:
        out = y.clone()
        torch.ops.ts_panels.lora_update_(x, out, *args)  # in place, as on a projection's own output
        return out

    def update(threads: int, rows: list[int]) -> torch.Tensor:
        torch.set_num_threads(threads)
        return op(x[rows].contiguous(), y[rows].contiguous(), a, bt, ranks, bounds, rank, slots[rows].contiguous(),
                  scales)

    together = update(2, list(range(7)))
    assert torch.equal(together, update(1, list(range(7))))
    for row in range(7):
        assert torch.equal(update(2, [row])[0], together[row])
    expect = y.double().clone()
    for row, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for p in range(len(parts)):
            used = int(ranks[s, p])
            lo, hi = p * rank, p * rank + used
            t = a[s, lo:hi].double() @ x[row].double()  # (used,)
            if scales is not None:
                t = t * scales[s, lo:hi].double()
            expect[row, bounds[p]:bounds[p + 1]] += t @ bt[s, lo:hi, bounds[p]:bounds[p + 1]].double()
    torch.testing.assert_close(together.double(), expect, rtol=1e-5, atol=1e-5)
