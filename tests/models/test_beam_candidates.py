"""A beam search step's candidates through the native kernel (ts_panels.beam_top): the same values and
indices as torch's add + topk over each group's rows * V (scores + log-probs), best first, with equal
values lowest index first and NaN below every number; and beam search through it = through torch.

Dimension legend: G groups (sources), R rows per group (beams), V vocabulary, k candidates.
"""

from __future__ import annotations

import pytest
import torch

from models import beam_search
from models.beam_search import BeamParams, translate_ids
from models.tiny import tiny_model

from .test_quant import needs_kernels

pytestmark = [needs_kernels, pytest.mark.usefixtures("one_torch_thread")]

INF = float("inf")


def torch_top(logp: torch.Tensor, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups, rows = scores.shape
    return (logp.view(groups, rows, -1) + scores[:, :, None]).view(groups, -1).topk(k, dim=-1)  # (G, k) each


@pytest.mark.parametrize("groups, rows, vocab, k", [(1, 1, 8000, 2), (3, 4, 8000, 8), (32, 4, 8000, 8),
                                                    (2, 8, 100, 16), (5, 2, 37, 3), (1, 1, 5, 5)])
def test_candidates_equal_torch_topk(groups: int, rows: int, vocab: int, k: int) -> None:
    gen = torch.Generator().manual_seed(groups * 1000 + vocab)
    logp = torch.randn(groups * rows, vocab, generator=gen).log_softmax(-1)  # (G * R, V)
    scores = torch.randn(groups, rows, generator=gen) * 5  # (G, R)
    values, index = torch.ops.ts_panels.beam_top(logp, scores, k)  # (G, k) each
    want_values, want_index = torch_top(logp, scores, k)
    assert torch.equal(values, want_values)  # the same float sums, bit for bit
    assert torch.equal(index, want_index)


def test_equal_values_come_lowest_index_first_and_nan_last() -> None:
    logp = torch.zeros(2, 20)  # (2, V): every candidate ties
    logp[0, 4] = float("nan")
    logp[1, 0] = 1.0
    values, index = torch.ops.ts_panels.beam_top(logp, torch.zeros(1, 2), 5)
    assert index.tolist() == [[20, 0, 1, 2, 3]]  # row 1's token 0 first, then the ties in order, no NaN
    assert values.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    forced = torch.full((2, 10), -INF)  # the forced end token: one finite candidate a row
    forced[0, 3] = forced[1, 7] = 0.0
    values, index = torch.ops.ts_panels.beam_top(forced, torch.tensor([[-1.0, -2.0]]), 4)
    assert index.tolist()[0][:2] == [3, 17] and values.tolist()[0] == [-1.0, -2.0, -INF, -INF]
    only_nan = torch.full((1, 3), float("nan"))  # fewer numbers than k: NaNs fill the rest
    values, index = torch.ops.ts_panels.beam_top(only_nan, torch.zeros(1, 1), 2)
    assert index.tolist() == [[0, 1]] and values.isnan().all()


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(RuntimeError, match="logp has"):
        torch.ops.ts_panels.beam_top(torch.zeros(3, 10), torch.zeros(1, 2), 2)
    with pytest.raises(RuntimeError, match="k must be"):
        torch.ops.ts_panels.beam_top(torch.zeros(2, 10), torch.zeros(1, 2), 21)


def test_beam_search_through_the_kernel_equals_torch_topk(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny_model("seq2seq")
    sources = [[5, 9, 12, 7, 0], [30, 31, 0], [44, 8, 19, 23, 61, 7, 3, 0], [11, 0]]
    params = [BeamParams(4, 12), BeamParams(1, 9), BeamParams(3, 12), BeamParams(4, 10, length_penalty=0.6)]
    calls = []
    native_top = beam_search._top
    monkeypatch.setattr(beam_search, "_top", lambda *a: calls.append(1) or native_top(*a))
    ours = translate_ids(model, sources, params)
    assert calls  # the kernel ran
    monkeypatch.setattr(beam_search, "_top", torch_top)
    assert translate_ids(model, sources, params) == ours
    assert len({tuple(t) for t in ours}) == len(ours)  # the tiny model's outputs depend on the source
