"""The compiled backend: `compile_blocks(model)` hands every Block to torch.compile, in place.

Regional: each Block is compiled, not the stack, so one graph serves every layer (parameters and cache
buffers are graph inputs); compiling a whole stack as one graph cost far more start-up than it saved
(docs/benchmarks-history.md, "Our own CPU kernels and compiled blocks"). Sizes are symbolic
(`dynamic=True`, no duck sizing), sizes of 1 specialise, and guards on module state are only the
structural ones (MODULE_GUARDS), so a block has a few graphs, which `warm_up` builds at load. Call it
after the layers are final (quantized, packed): catalog.load_model compiles last, and the planner
(planner.py) then gives it the phases it runs. torch keeps compiler settings per thread: a thread that
runs compiled blocks calls `thread_settings()` first. Results: eager's to ~1e-5 (test_compiled.py).
Past torch's recompile limit a block's new shapes would run eager, silently: warming up past it fails
the compilation (the plan then says so and the model is served eager), and a hit while serving is
logged as an error and counted (`recompile_limit_hits`).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from ..layers import Block

log = logging.getLogger("models.execution.compiled")
# Guards kept on module state: what tells one kind of block from another (a submodule's type, a
# None, a flag, a head count), not the parameters' tensors or the hook dictionaries
RECOMPILE_LIMIT = 128
MODULE_GUARDS = frozenset({"TYPE_MATCH", "CONSTANT_MATCH", "EQUALS_MATCH"})


def structural_guards(entries: list) -> list[bool]:
    """guard_filter_fn: every guard on inputs and globals; on modules only MODULE_GUARDS."""
    return [not e.orig_guard.source.is_unspecialized_nn_module() or e.guard_type in MODULE_GUARDS for e in entries]


OPTIONS = {"guard_filter_fn": structural_guards}


class RecompileLimitHit(RuntimeError):
    """Warming up passed torch's recompile limit: some of the blocks' graphs would run eager."""


class _LimitWatch(logging.Handler):
    """Reads torch's "hit config.recompile_limit" warning (torch._dynamo.convert_frame): the function
    whose new shapes run eager from then on. Attached once, by compile_blocks."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if not text.startswith("torch._dynamo hit config."):
            return
        where = text.splitlines()[1].strip() if "\n" in text else text
        self.hits.append(where)
        log.error("a compiled block passed torch's recompile limit (%s): its new shapes run eager from now on",
                  where)


_WATCH = _LimitWatch()


def recompile_limit_hits() -> int:
    """How many times, in this process, a compiled block passed torch's recompile limit."""
    return len(_WATCH.hits)


def thread_settings() -> None:
    """torch's compiler settings the compiled blocks need, for the calling thread: torch keeps them
    per thread (context variables), so a thread that runs compiled blocks (an engine's) calls this
    first; compile_blocks does it for its own."""
    # no "duck sizing": sizes that happen to be equal while tracing (a cache of 8 slots and a head
    # dim of 8, 2 kv heads and a 2-token prompt) would otherwise be assumed equal and recompile later
    torch.fx.experimental._config.use_duck_shape = False
    # graphs are kept per code object, and every Block shares one: a translator's encoder and decoder
    # blocks, a decoder's dense and paged caches, and their 1-row / n-row, first-step / later-step
    # variants pass torch's default of 8 (past the limit a block runs eager); a generator and its
    # prompt twin warm up a few dozen
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def compile_blocks(model: nn.Module) -> int:
    """Compile every Block of `model` in place (nn.Module.compile); returns how many."""
    thread_settings()
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    if _WATCH not in dynamo_log.handlers:
        dynamo_log.addHandler(_WATCH)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile(dynamic=True, options=OPTIONS)
    return len(blocks)


def is_compiled(model: nn.Module) -> bool:
    """Whether compile_blocks compiled `model`'s blocks (and uncompile_blocks did not undo it)."""
    return any(m._compiled_call_impl is not None for m in model.modules() if isinstance(m, Block))


def uncompile_blocks(model: nn.Module) -> None:
    """Undo compile_blocks: every Block runs eager again."""
    for m in model.modules():
        if isinstance(m, Block):
            m._compiled_call_impl = None


@torch.inference_mode()
def warm_up(model: nn.Module, kv_dtype: torch.dtype | None = None) -> float:
    """Run the shapes serving meets (1 and 2 rows; prefill and decode steps on a KV cache of `kv_dtype`,
    the engine's, None: the model's dtype; an encoder's padded batch) so their graphs compile now.
    Returns the seconds it took; RecompileLimitHit where a graph it needs passed torch's recompile limit
    (that shape would run eager: the caller serves the model eager, and its plan says why)."""
    from ..cache.dense import KVCache
    from ..cache.paged import BLOCK_TOKENS, PagedKVCache
    from ..decoder import DecoderLM
    from ..encoder import EncoderModel
    from ..seq2seq import Seq2Seq

    started, hits = time.perf_counter(), recompile_limit_hits()
    device, dtype = next(model.parameters()).device, kv_dtype or next(model.parameters()).dtype
    if isinstance(model, Seq2Seq):  # through beam search itself: its cache rows and reordered cross keys
        from ..beam_search import BeamParams, translate_ids

        source = [3, 3, model.cfg.eos_token_id]
        for rows in (1, 2):
            for beam in (1, 4):
                translate_ids(model, [source] * rows, BeamParams(beam, 3))
    for rows in (1, 2):
        src = torch.full((rows, 3), 3, dtype=torch.long, device=device)  # (B, 3)
        keep = torch.ones_like(src, dtype=torch.bool)  # (B, 3)
        keep[-1, -1] = rows == 1  # with two rows, one padded
        if isinstance(model, EncoderModel):
            model.embed(src, keep)
        elif isinstance(model, DecoderLM):
            # the dense cache (models.generate) and, but for a sliding window, the paged one (the engine)
            # (cache, the tokens of its forwards in turn): a prefill on an empty cache (S = T >= 2),
            # decode steps (T = 1, S > 1), then a prefill after a past (T >= 2, S > T: a prefix cache
            # hit, a chunk of a long prompt); 6 tokens fit the dense cache
            caches = [(KVCache.for_model(model.cfg, rows, 8, dtype=dtype, device=device), (2, 1, 1, 2))]
            if model.cfg.sliding_window is None:
                # rows within one block, then rows over two (sizes 1 specialise: a table of one block too,
                # so a prompt over two blocks on empty rows, as most served prompts are)
                for past, steps in ((0, (2, 1, 1, 2)), (15, (2, 1, 1, 2)), (0, (BLOCK_TOKENS + 1,))):
                    paged = PagedKVCache.for_model(model.cfg, rows, 2 * rows + 1, 32, dtype=dtype, device=device)
                    for row in range(rows):
                        paged.ensure(row, past)
                    paged.set_lengths(past)
                    caches.append((paged, steps))
            for cache, steps in caches:
                for t in steps:
                    model(torch.full((rows, t), 3, dtype=torch.long, device=device), cache=cache.view())
                    cache.advance(t)
    if recompile_limit_hits() > hits:
        raise RecompileLimitHit(f"warming up passed torch's recompile limit of "
                                f"{torch._dynamo.config.recompile_limit} graphs a block ({_WATCH.hits[-1]})")
    seconds = time.perf_counter() - started
    log.info("compiled blocks warmed up in %.1f s", seconds)
    return seconds
