"""The cuda_graphs backend: decode steps (one new token per row over a paged KV cache) captured as CUDA
graphs and replayed, since eager steps are bound by the host's kernel launches (docs/benchmarks.md,
"GPU"). `DecodeGraphs.step` pads a step to a bucket, R rows x nb key blocks (1, 2, 4, ... up to the
cache's rows and a table's width), one graph per bucket, captured by `capture_all` at warm-up or at
first use. A bucket's inputs (`FixedStep`: ids, positions, slots, tables, keys) are views of one int64
buffer the host fills with one non-blocking copy; padding rows write the pool's trash slot and read
the null block, and their logits are cut off. Nothing captured syncs with the host; the returned
logits are the graph's buffer (read before the next step) and the caller advances the lengths. On the
CPU (tests) the same padded steps run eagerly (`capture=False`); loadtests/gpu/check.py runs the graphs.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..cache.paged import PagedCacheView, PagedKVCache, blocks_for

log = logging.getLogger(__name__)

# attention kernels a capture falls back to when the default ones fail to capture
FALLBACK_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class GraphCaptureError(RuntimeError):
    """A decode step could not be captured (an op that synchronizes or allocates on the host)."""


def buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `limit`, then `limit`: the sizes steps are padded to."""
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    return (*sizes, limit)


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest of `sizes` (ascending) that holds n."""
    return next(s for s in sizes if s >= n)


@dataclass
class FixedStep(PagedCacheView):
    """A decode step of R rows attending nb key blocks, over static buffers (a graph's inputs).

    All five inputs are views of one int64 buffer (`packed`), so the host fills them with one copy:
    ids (R, 1), positions (R, 1), slots (R * K,), tables (R, nb), keys (R,)."""

    rows: int = 0
    blocks: int = 0
    packed: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    @classmethod
    def build(cls, cache: PagedKVCache, rows: int, blocks: int) -> FixedStep:
        k = cache.kv_heads
        size = rows * (3 + k + blocks)
        step = cls(cache, 0, rows, native=False, rows=rows, blocks=blocks,
                   packed=torch.zeros(size, dtype=torch.long, device=cache.tables.device))
        step.packed.copy_(step.host_inputs([], []))  # every row padding: a warm-up or a capture writes only trash
        step.step_len = blocks * cache.block
        return step

    def _views(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        r, k, nb = self.rows, self.cache.kv_heads, self.blocks
        ids, positions, slots, tables, keys = self.packed.split([r, r, r * k, r * nb, r])
        return ids.view(r, 1), positions.view(r, 1), slots, tables.view(r, nb), keys  # (R,1) (R,1) (R*K,) (R,nb) (R,)

    @property
    def ids(self) -> Tensor:
        return self._views()[0]  # (R, 1)

    def begin(self, t: int, keep: Tensor | None = None) -> tuple[Tensor, int]:
        """The step's positions (R, 1) and S = nb * BS: the host filled the buffers (`host_inputs`)."""
        if t != 1 or keep is not None:
            raise ValueError("a fixed step takes one token per row, unpadded")
        _, positions, self._slots, self._tables, self._keys = self._views()
        assert self.step_len is not None
        return positions, self.step_len

    def host_inputs(self, pending: list[int], rows: list[int]) -> Tensor:
        """The packed inputs for cache rows `rows` (their blocks already ensured) whose pending tokens
        are `pending`, padded to R rows: a pinned host tensor where the device is CUDA."""
        c = self.cache
        pad = self.rows - len(rows)
        lengths = [c.host_lengths[r] for r in rows]
        slots: list[int] = []
        tables: list[int] = []
        for row, n in zip(rows, lengths, strict=True):
            slots += c.key_slots(row, n)
            head = c.host_tables[row][:self.blocks]
            tables.extend(head + [0] * (self.blocks - len(head)))  # past the row's blocks: the null block
        values = (pending + [0] * pad  # ids
                  + lengths + [0] * pad  # positions: padding rows at 0 ...
                  + slots + [c.trash] * (pad * c.kv_heads)  # ... write to the trash slot ...
                  + tables + [0] * (pad * self.blocks)
                  + [n + 1 for n in lengths] + [1] * pad)  # ... and attend one key (of the null block)
        host = torch.tensor(values, dtype=torch.long)
        return host.pin_memory() if self.packed.is_cuda else host


class DecodeGraphs:
    """One-token decode steps of `model` over `cache`, by bucket: captured CUDA graphs on CUDA
    (`capture`), the same padded steps run eagerly elsewhere."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, capture: bool | None = None) -> None:
        self.model, self.cache = model, cache
        self.capture = cache.tables.is_cuda if capture is None else capture
        self.row_buckets = buckets(cache.rows)
        self.block_buckets = buckets(cache.width)
        self._steps: dict[tuple[int, int], tuple[FixedStep, Tensor, torch.cuda.CUDAGraph | None]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @staticmethod
    def supported(model: nn.Module, cache: object) -> bool:
        """A decoder the captured step computes as its forward does: a paged cache, no sliding window
        and no relative position bias (their masks and biases are built per step on the host)."""
        cfg = getattr(model, "cfg", None)
        return (isinstance(cache, PagedKVCache) and cfg is not None and cfg.sliding_window is None
                and cfg.position != "relative")

    def _forward(self, step: FixedStep) -> Tensor:
        return self.model(step.ids, cache=step)[:, 0]  # (R, V)

    def _build(self, rows: int, blocks: int) -> tuple[FixedStep, Tensor, torch.cuda.CUDAGraph | None]:
        step = FixedStep.build(self.cache, rows, blocks)
        if not self.capture:
            return step, torch.empty(0), None
        errors = []
        for backends in (None, FALLBACK_BACKENDS):  # the default attention kernels, then ones known to capture
            try:
                out, graph = self._capture(step, backends)
                if errors:
                    log.warning("decode-step graphs: %s; captured with %s instead", errors[0], backends)
                return step, out, graph
            except Exception as exc:  # noqa: BLE001 - the next backends, or the caller steps eagerly
                errors.append(f"{type(exc).__name__}: {exc}"[:500])
        raise GraphCaptureError(f"decode step of {rows} rows x {blocks} key blocks: {'; '.join(errors)}")

    def _capture(self, step: FixedStep, backends: list | None) -> tuple[Tensor, torch.cuda.CUDAGraph]:
        with sdpa_kernel(backends) if backends else nullcontext():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up launches (cuBLAS handles, workspaces) outside the graph
                for _ in range(2):
                    self._forward(step)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(step)  # (R, V): the graph's output buffer
        return out, graph

    def _get(self, rows: int, blocks: int) -> tuple[FixedStep, Tensor, torch.cuda.CUDAGraph | None]:
        key = (rows, blocks)
        if key not in self._steps:
            self._steps[key] = self._build(rows, blocks)
        return self._steps[key]

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every bucket now (a replica's warm-up), so no request pays for a capture; returns
        the number of graphs."""
        for rows in self.row_buckets:
            for blocks in self.block_buckets:
                self._get(rows, blocks)
        return len(self._steps)

    def step(self, pending: list[int], start: int, stop: int, ids: Tensor | None = None) -> Tensor:
        """Logits (B, V) of one decode step for cache rows [start, stop) whose next input tokens are
        `pending`, or `ids` (B,) on the device (then pending is ignored: a step launched before its
        tokens reached the host); the cache lengths do not advance (the caller advances them after
        sampling). The result is the graph's buffer: read it before the next step."""
        c, rows = self.cache, list(range(start, stop))
        for row in rows:
            c.ensure(row, c.host_lengths[row] + 1)
        longest = max(c.host_lengths[r] for r in rows) + 1
        if longest > c.max_len:
            raise ValueError(f"KV cache holds {c.max_len} tokens per row; this step needs {longest}")
        step, out, graph = self._get(bucket(len(rows), self.row_buckets),
                                     bucket(min(blocks_for(longest, c.block), c.width), self.block_buckets))
        step.packed.copy_(step.host_inputs(pending if ids is None else [0] * len(rows), rows), non_blocking=True)
        if ids is not None:
            step.packed[:len(rows)].copy_(ids)  # after the host's copy on the same stream: the ids win
        if graph is None:
            return self._forward(step)[:len(rows)]  # (B, V)
        graph.replay()
        return out[:len(rows)]  # (B, V)
