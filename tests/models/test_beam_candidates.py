"""A beam search step's candidates through the native kernels (select.cpp): beam_top gives the same values
and indices as torch's add + topk over each group's rows * V (scores + log-probs), best first, with equal
values lowest index first and NaN below every number; search_select, the whole selection from the
logits, gives what the torch path gives (log-softmax, banned tokens, the forced end token, argmax or
best candidates); and beam search through them = through torch.

Dimension legend: G groups (sources), R rows per group (beams), V vocabulary, k candidates.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from models import beam_search
from models.beam_search import BeamParams, _Request, translate_ids
from models.cache.paged import kernel_runs
from models.execution.planner import plan_model
from models.kernels import native
from models.tiny import tiny_model
from tests.models.projections.test_quant import needs_kernels

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
    values, index = native.module().beam_top(logp, scores, k)  # (G, k) each
    want_values, want_index = torch_top(logp, scores, k)
    assert torch.equal(values, want_values)  # the same float sums, bit for bit
    assert torch.equal(index, want_index)


def test_equal_values_come_lowest_index_first_and_nan_last() -> None:
    logp = torch.zeros(2, 20)  # (2, V): every candidate ties
    logp[0, 4] = float("nan")
    logp[1, 0] = 1.0
    values, index = native.module().beam_top(logp, torch.zeros(1, 2), 5)
    assert index.tolist() == [[20, 0, 1, 2, 3]]  # row 1's token 0 first, then the ties in order, no NaN
    assert values.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    forced = torch.full((2, 10), -INF)  # the forced end token: one finite candidate a row
    forced[0, 3] = forced[1, 7] = 0.0
    values, index = native.module().beam_top(forced, torch.tensor([[-1.0, -2.0]]), 4)
    assert index.tolist()[0][:2] == [3, 17] and values.tolist()[0] == [-1.0, -2.0, -INF, -INF]
    only_nan = torch.full((1, 3), float("nan"))  # fewer numbers than k: NaNs fill the rest
    values, index = native.module().beam_top(only_nan, torch.zeros(1, 1), 2)
    assert index.tolist() == [[0, 1]] and values.isnan().all()


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(RuntimeError, match="logp has"):
        native.module().beam_top(torch.zeros(3, 10), torch.zeros(1, 2), 2)
    with pytest.raises(RuntimeError, match="k must be"):
        native.module().beam_top(torch.zeros(2, 10), torch.zeros(1, 2), 21)


def test_beam_search_through_the_kernel_equals_torch_topk(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny_model("seq2seq")
    sources = [[5, 9, 12, 7, 0], [30, 31, 0], [44, 8, 19, 23, 61, 7, 3, 0], [11, 0]]
    params = [BeamParams(4, 12), BeamParams(1, 9), BeamParams(3, 12), BeamParams(4, 10, length_penalty=0.6)]
    calls = []
    built = native.module()
    spy = SimpleNamespace(**{name: getattr(built, name) for name in dir(built) if not name.startswith("_")})
    spy.search_select = lambda *a: calls.append(1) or built.search_select(*a)
    monkeypatch.setattr(native, "module", lambda: spy)
    executor = plan_model(model)
    assert executor.native_select
    ours = translate_ids(executor, sources, params, banned_ids=[1, 2])
    assert calls  # the kernel ran
    executor.native_select = False
    monkeypatch.setattr(beam_search, "_top", torch_top)
    assert translate_ids(executor, sources, params, banned_ids=[1, 2]) == ours
    assert len({tuple(t) for t in ours}) == len(ours)  # the tiny model's outputs depend on the source


def _live(rows_beams_steps: list[tuple[int, int, int, int]], rng: torch.Generator) -> list[_Request]:
    """Requests as a step sees them: (rows, beam size, step, max new tokens) each, random running scores."""
    return [_Request(BeamParams(n, limit), rows, [[] for _ in range(rows)],
                     (-torch.rand(rows, generator=rng) * 5).tolist() if n > 1 else [0.0], [], step=step)
            for rows, n, step, limit in rows_beams_steps]


@pytest.mark.parametrize("requests", [
    [(1, 1, 0, 9)],  # one greedy row
    [(1, 4, 0, 12), (1, 1, 3, 9), (4, 4, 5, 12), (3, 3, 11, 12)],  # beams widening, greedy, one at its limit
    [(4, 4, 2, 20)] * 5 + [(1, 1, 7, 8)] * 3,  # a batch of beam searches and greedy rows at their limit
])
def test_the_native_selection_is_the_torch_path(requests: list[tuple[int, int, int, int]]) -> None:
    rng = torch.Generator().manual_seed(len(requests))
    live = _live(requests, rng)
    rows = sum(req.rows for req in live)
    logits = torch.randn(rows, 300, generator=rng) * 4  # (R, V)
    logits[0, 7] = logits[0].max()  # a tie with the row's best: the lower index wins on both paths
    banned, eos = [1, 299], 2
    assert kernel_runs(logits.dtype, logits.device)
    ours = beam_search._select(live, logits, banned, eos, native_runs=True)
    want = beam_search._candidates(live, _torch_logp(live, logits, banned, eos))
    assert ours == want
    for req, (values, _, tokens) in zip(live, ours, strict=True):
        finite = {t for t, v in zip(tokens, values, strict=True) if v != -INF}  # candidates that can be chosen
        assert finite and not finite & set(banned)
        if req.step + 1 >= req.params.max_new_tokens:  # at its limit only eos
            assert finite == {eos}
        assert len(tokens) == (1 if req.params.beam_size == 1 else 2 * req.params.beam_size)


def _torch_logp(live: list[_Request], logits: torch.Tensor, banned: list[int], eos: int) -> torch.Tensor:
    logp = logits.log_softmax(-1)  # (R, V)
    logp[:, banned] = -INF
    first = 0
    for req in live:
        if req.step + 1 >= req.params.max_new_tokens:
            logp[first: first + req.rows] = -INF
            logp[first: first + req.rows, eos] = 0.0
        first += req.rows
    return logp


def test_the_native_selection_refuses_what_does_not_fit() -> None:
    select = native.module().search_select
    with pytest.raises(RuntimeError, match="the logits 3"):
        select(torch.zeros(3, 10), [], 0, [1, 1], [1, 1], [False, False], [[0.0], [0.0]])
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        select(torch.zeros(1, 10), [10], 0, [1], [1], [False], [[0.0]])
    with pytest.raises(RuntimeError, match="scores"):
        select(torch.zeros(2, 10), [], 0, [2], [2], [False], [[0.0]])
