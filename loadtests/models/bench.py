"""Ours vs transformers on the same weights and inputs, side by side in one run.

    python -m loadtests.models.bench [--quick] [--json out.json]     (make bench)

1. MiniLM encoder forward (padded batch of mixed-length texts) at batch 1 / 8 / 32: texts per second.
2. SmolLM2-135M greedy decoding at batch 1 and 32: generated tokens per second, ours
   (models.generate with the KV cache) vs transformers' `generate` (left padding, its own cache).
Both sides run fp32 on the same threads, alternating, and the table reports medians and ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from models import zoo
from models.catalog import DEFAULT_SPECS, load_model
from models.decoding import SamplingParams
from models.generate import generate
from models.reference import transformers_encoder, transformers_from_gguf

log = logging.getLogger("bench")

WORDS = ["the", "service", "batches", "requests", "of", "many", "lengths", "so", "that", "padding", "stays", "low", "while", "latency", "remains", "bounded", "and", "every", "client", "gets", "its", "own", "answer", "back", "in", "order"]


def mixed_texts(n: int, rng: random.Random) -> list[str]:
    """Texts of skewed lengths (mostly short, some long), like real traffic."""
    return [" ".join(rng.choice(WORDS) for _ in range(min(120, int(rng.paretovariate(1.2) * 6))))
            for _ in range(n)]


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_encoder(cache_dir: Path, batches: list[int], repeats: int, rng: random.Random) -> list[dict]:
    lm = load_model(dataclasses.replace(DEFAULT_SPECS["encoder"], head=None), cache_dir)
    ours = lm.executor.hidden  # on the plan chosen at load, as served
    ref = transformers_encoder(zoo.resolve("minilm", cache_dir))
    rows = []
    for b in batches:
        texts = mixed_texts(b, rng)
        enc = lm.tokenizer.tok.encode_batch(texts)
        width = max(len(e.ids) for e in enc)
        ids = torch.zeros(b, width, dtype=torch.long)
        keep = torch.zeros(b, width, dtype=torch.bool)
        for i, e in enumerate(enc):
            ids[i, : len(e.ids)] = torch.tensor(e.ids)
            keep[i, : len(e.ids)] = True
        with torch.inference_mode():
            t_ours = timed(lambda ids=ids, keep=keep: ours(ids, keep), repeats)  # hidden states, as HF's
            t_ref = timed(lambda ids=ids, keep=keep: ref(input_ids=ids, attention_mask=keep.long()), repeats)
        rows.append({"bench": "MiniLM encoder forward", "batch": b, "unit": "texts/s",
                     "ours": b / t_ours, "transformers": b / t_ref, "ratio": t_ref / t_ours})
        log.info("encoder batch %d: ours %.1f texts/s, transformers %.1f texts/s", b, b / t_ours, b / t_ref)
    return rows


def bench_decoder(cache_dir: Path, batches: list[int], new_tokens: int, repeats: int,
                  rng: random.Random) -> list[dict]:
    lm = load_model(DEFAULT_SPECS["generator"], cache_dir)
    (gguf_name,) = zoo.ZOO["smollm2"].files
    ref = transformers_from_gguf(zoo.resolve("smollm2", cache_dir), gguf_name)
    pad = lm.model.cfg.pad_token_id or 0
    rows = []
    for b in batches:
        prompts = [lm.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))),
                                       add_special_tokens=False) for _ in range(b)]
        width = max(map(len, prompts))
        ids = torch.full((b, width), pad, dtype=torch.long)  # left-padded for transformers
        mask = torch.zeros(b, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)

        def run_ours(prompts=prompts, params=params):
            return generate(lm.executor, prompts, params)

        def run_ref(ids=ids, mask=mask):
            return ref.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=pad)

        with torch.inference_mode():
            t_ours = timed(run_ours, repeats)
            t_ref = timed(run_ref, repeats)
        total = b * new_tokens
        rows.append({"bench": "SmolLM2 greedy decoding", "batch": b, "unit": "tokens/s",
                     "ours": total / t_ours, "transformers": total / t_ref, "ratio": t_ref / t_ours})
        log.info("decoder batch %d: ours %.1f tok/s, transformers %.1f tok/s", b, total / t_ours, total / t_ref)
    return rows


def render(rows: list[dict]) -> str:
    lines = ["| benchmark | batch | ours | transformers | ours / transformers |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['bench']} ({r['unit']}) | {r['batch']} | {r['ours']:.1f} | {r['transformers']:.1f} "
                     f"| {r['ratio']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and tokens (a smoke run)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cache_dir = zoo.default_cache_dir()
    rng = random.Random(0)
    repeats = 1 if args.quick else 3
    rows = bench_encoder(cache_dir, [1, 8, 32], repeats * 3, rng)
    rows += bench_decoder(cache_dir, [1, 32], 8 if args.quick else 32, repeats, rng)
    table = render(rows)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32\n")
    print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
