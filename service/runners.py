"""What a model replica does, without Ray: tokenize, batch, run the model, convert results.

A runner owns a loaded model, its dynamic batcher and its inference thread. Tokenization happens
on the replica's event loop when a request arrives (lengths are needed to group and budget the
batch); each text's failure (it breaks the tokenizer, it is too long) fails only its own request.
Results cross back to the ingress as plain dataclasses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from models.beam_search import BeamParams, translate_ids
from models.catalog import LoadedModel
from models.text import TextTokenizer

from .batch_metrics import BatchObserver
from .batching import BatchLimits, DynamicBatcher, PaddedBatch
from .errors import InvalidItem, InvalidRequest
from .heap import HeapTrimmer
from .messages import Classification, Embeddings, ModelInfo, TranslateOptions

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str, dtype: str) -> tuple[str, torch.dtype]:
    """"auto" -> cuda + bfloat16 when this process sees a GPU, else cpu + float32. dtype
    "auto-bf16" is "auto", but bfloat16 also on a CPU that multiplies it natively (AMX-BF16)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype in ("auto", "auto-bf16"):
        native = device.startswith("cuda") or (dtype == "auto-bf16" and device == "cpu" and cpu_has_amx_bf16())
        dtype = "bfloat16" if native else "float32"
    return device, DTYPES[dtype]


def cpu_has_amx_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AMX-BF16 tiles (Intel Sapphire Rapids and later), where oneDNN's bfloat16
    matmuls run 1.6x (32 rows) to 3.8x (256 rows) faster than float32 ones (docs/benchmarks.md).
    Without them bfloat16 is emulated and slower than float32. Linux only; False elsewhere."""
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False


def tokenize(tokenizer: TextTokenizer, texts: Sequence[str], limit: int, truncate: bool) -> list[list[int]]:
    """Token ids (with the model's special tokens) per text, each at most `limit` long.

    Raises InvalidItem(index) for a text that is empty, breaks the tokenizer, or is too long
    without `truncate`. Truncation cuts the text's tokens and keeps the special tokens.
    """
    out: list[list[int]] = []
    for i, text in enumerate(texts):
        try:
            ids = tokenizer.encode(text)
        except Exception as e:  # e.g. lone surrogates that are not UTF-8
            raise InvalidItem(f"the text could not be tokenized ({type(e).__name__}: {e})", i) from None
        if len(ids) > limit:
            if not truncate:
                raise InvalidItem(f"the text has {len(ids)} tokens; this model accepts at most {limit} "
                                  f"(send \"truncate\": true to cut it)", i)
            ids = _truncate(tokenizer, text, limit)
        if not ids:
            raise InvalidItem("the text has no tokens", i)
        out.append(ids)
    return out


def _truncate(tokenizer: TextTokenizer, text: str, limit: int) -> list[int]:
    n_special = len(tokenizer.encode(""))
    enc = tokenizer.tok.encode(text, add_special_tokens=False)
    enc.truncate(max(limit - n_special, 0))
    return tokenizer.tok.post_process(enc).ids


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


class Runner:
    """Shared by every model kind: the loaded model, one inference thread, the batcher, info()."""

    def __init__(self, loaded: LoadedModel, deployment: str, limits: BatchLimits,
                 observer: BatchObserver | None = None, heap: HeapTrimmer | None = None) -> None:
        self.loaded = loaded
        self.deployment = deployment
        self.heap = heap or HeapTrimmer(0)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{deployment}-inference")
        self.batcher: DynamicBatcher[Any, Any] = DynamicBatcher(self._compute, limits, self.executor,
                                                                name=deployment, observer=observer)
        self.loaded_at = time.time()

    def _compute(self, payloads: list[Any]) -> list[Any]:
        """One batch on the inference thread, then the C heap trimmed if its interval passed."""
        try:
            return self.run_batch(payloads)
        finally:
            self.heap.maybe_trim()

    def run_batch(self, payloads: list[Any]) -> list[Any]:
        raise NotImplementedError

    def warm_up(self) -> None:
        """Run the model once on a small batch (allocations, kernels) before the replica is ready."""
        raise NotImplementedError

    def info(self) -> ModelInfo:
        spec, loaded = self.loaded.spec, self.loaded
        return ModelInfo(
            name=spec.name, deployment=self.deployment, tasks=tuple(spec.tasks), device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."), max_input_tokens=loaded.max_input_tokens,
            labels=tuple(loaded.labels), languages=spec.languages, defaults=dict(spec.defaults),
            loaded_at=self.loaded_at, load_seconds=loaded.load_seconds,
            stats={**self.batcher.stats.as_dict(), "queued": self.batcher.queued})  # queued: inputs waiting now

    async def close(self) -> None:
        await self.batcher.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class EncodeItem:
    ids: list[int]
    classify: bool  # else: embedding


class EncoderRunner(Runner):
    """Classification and embeddings on one encoder; both tasks share batches (one forward pass)."""

    def __init__(self, loaded: LoadedModel, deployment: str, limits: BatchLimits,
                 observer: BatchObserver | None = None, heap: HeapTrimmer | None = None) -> None:
        super().__init__(loaded, deployment, limits, observer, heap)
        if "classify" in loaded.spec.tasks and not loaded.labels:
            raise ValueError(f"model {loaded.spec.name!r} serves classify but has no classification head "
                             "(set `head` in its model settings)")
        pad = loaded.model.cfg.pad_token_id
        self.pad_id = pad if pad is not None else 0

    async def classify(self, texts: Sequence[str], truncate: bool, timeout_s: float | None) -> list[Classification]:
        ids = tokenize(self.loaded.tokenizer, texts, self.loaded.max_input_tokens, truncate)
        return await self.batcher.submit_many([EncodeItem(x, True) for x in ids], [len(x) for x in ids],
                                              _deadline(timeout_s))

    async def embed(self, texts: Sequence[str], truncate: bool, timeout_s: float | None) -> Embeddings:
        ids = tokenize(self.loaded.tokenizer, texts, self.loaded.max_input_tokens, truncate)
        vectors = await self.batcher.submit_many([EncodeItem(x, False) for x in ids], [len(x) for x in ids],
                                                 _deadline(timeout_s))
        return Embeddings(vectors, sum(len(x) for x in ids))

    @torch.inference_mode()
    def run_batch(self, payloads: list[EncodeItem]) -> list[Classification | list[float]]:
        model = self.loaded.model
        batch = PaddedBatch.from_token_lists([p.ids for p in payloads], self.pad_id, self.loaded.device)
        pooled = model.embed(batch.ids, batch.keep)  # (B, C)
        rows = [i for i, p in enumerate(payloads) if p.classify]
        out: list[Any] = pooled.float().cpu().tolist()
        if rows:
            probs = model.head(pooled[rows]).float().softmax(-1).cpu()  # (b, n_labels)
            labels = self.loaded.labels
            for row, p in zip(rows, probs.tolist(), strict=True):
                best = max(range(len(p)), key=p.__getitem__)
                out[row] = Classification(labels[best], p[best], dict(zip(labels, p, strict=True)))
        return out

    def warm_up(self) -> None:
        tok = self.loaded.tokenizer
        texts = ["warm up", "a slightly longer sentence to warm up the encoder"]
        ids = tokenize(tok, texts, self.loaded.max_input_tokens, truncate=True)
        self.run_batch([EncodeItem(ids[0], bool(self.loaded.labels)), EncodeItem(ids[1], False)])


@dataclass(frozen=True)
class TranslateItem:
    ids: list[int]
    params: BeamParams


class TranslatorRunner(Runner):
    """Beam search on the encoder-decoder; each item keeps its own beam size and length limit inside
    a shared batch (translate_ids takes one BeamParams per source)."""

    def __init__(self, loaded: LoadedModel, deployment: str, limits: BatchLimits,
                 observer: BatchObserver | None = None, heap: HeapTrimmer | None = None) -> None:
        super().__init__(loaded, deployment, limits, observer, heap)
        cfg = loaded.model.cfg
        self.banned = sorted({t for t in (cfg.pad_token_id, cfg.decoder_start_token_id) if t is not None}
                             - {cfg.eos_token_id})
        self.max_new_limit = cfg.max_positions - 1

    def params(self, options: TranslateOptions) -> BeamParams:
        defaults = self.loaded.spec.defaults
        beam = options.beam_size or int(defaults.get("beam_size", 4))
        max_new = options.max_new_tokens or int(defaults.get("max_new_tokens", 128))
        if max_new > self.max_new_limit:
            raise InvalidRequest(f"max_new_tokens is {max_new}; model {self.loaded.spec.name!r} can generate "
                                 f"at most {self.max_new_limit}", "max_new_tokens")
        return BeamParams(beam_size=beam, max_new_tokens=max_new)

    async def translate(self, texts: Sequence[str], options: TranslateOptions,
                        timeout_s: float | None) -> list[str]:
        params = self.params(options)
        ids = tokenize(self.loaded.tokenizer, texts, self.loaded.max_input_tokens, options.truncate)
        return await self.batcher.submit_many([TranslateItem(x, params) for x in ids], [len(x) for x in ids],
                                              _deadline(timeout_s))

    def run_batch(self, payloads: list[TranslateItem]) -> list[str]:
        out = translate_ids(self.loaded.model, [p.ids for p in payloads], [p.params for p in payloads],
                            banned_ids=self.banned)
        return self.loaded.tokenizer.decode_batch(out)

    def warm_up(self) -> None:
        ids = tokenize(self.loaded.tokenizer, ["warm up", "warm up the translator"],
                       self.loaded.max_input_tokens, truncate=True)
        self.run_batch([TranslateItem(ids[0], BeamParams(1, 2)), TranslateItem(ids[1], BeamParams(2, 2))])


RUNNERS: dict[str, type[Runner]] = {"encoder": EncoderRunner, "translator": TranslatorRunner}
