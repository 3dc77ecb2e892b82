"""Model-only ceilings for the classification targets: how many texts per second the models alone
reach on this machine, with no HTTP, no Ray and no queueing, on the benchmark's own texts.

    python -m loadtests.experiments.ceiling [--threads 1] [--texts 256]

It runs our encoder + head on length-sorted batches of 1, 4, 8, 16 and 32 texts, and the
`transformers` classifier of the plain system one text at a time (what each of its requests does).
The best of ours over transformers' one-at-a-time figure bounds the throughput ratio any batching
server can reach over the plain one on the same threads, before it pays for a single HTTP hop.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from models import zoo
from models.catalog import DEFAULT_SPECS, load_model

from .. import workload
from ..systems.hf_models import build_classifier, encode, pad

log = logging.getLogger("ceiling")


def _rate(run: Callable[[Sequence[str]], object], texts: Sequence[str], batch: int, repeats: int) -> float:
    """Texts per second over all `texts` in length-sorted batches of `batch` (median of repeats)."""
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    run(batches[0])  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for b in batches:
            run(b)
        times.append(time.perf_counter() - start)
    return len(texts) / statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the benchmark's default is 1)")
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    cache_dir = zoo.default_cache_dir()
    spec = DEFAULT_SPECS["encoder"]
    ours = load_model(spec, cache_dir)
    theirs = build_classifier(spec, cache_dir, "cpu").model
    texts = workload.sample_texts(workload.load_sentences(), args.texts, random.Random(args.seed))
    limit, pad_id = ours.max_input_tokens, ours.model.cfg.pad_token_id or 0
    texts.sort(key=lambda t: len(encode(ours.tokenizer, t, limit)))

    @torch.inference_mode()
    def run_ours(batch: Sequence[str]) -> object:
        ids, mask = pad([encode(ours.tokenizer, t, limit) for t in batch], pad_id, left=False, device="cpu")
        return ours.model.head(ours.model.embed(ids, mask.bool())).softmax(-1)  # (B, n_labels)

    plain = _rate(theirs, texts, 1, args.repeats)
    rows = [("transformers, one text per call (plain)", 1, plain)]
    rows += [("ours, length-sorted batches", b, _rate(run_ours, texts, b, args.repeats)) for b in (1, 4, 8, 16, 32)]
    print(f"\n{args.texts} classification texts of the benchmark's mix, {args.threads} torch thread(s)\n")
    print("| model work | batch | texts/s | × plain |")
    print("|---|---:|---:|---:|")
    for name, b, rate in rows:
        print(f"| {name} | {b} | {rate:.1f} | {rate / plain:.2f} |")


if __name__ == "__main__":
    main()
