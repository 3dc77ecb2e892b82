"""fp32 vs the quantized modes (models/projections/quant.py) on the default models, side by side in one run.

    python -m loadtests.models.quant [--modes int8,q8_0,q4_1,q4_1+a8] [--quick] [--threads 2] [--json out.json]
                                     [--models generator,encoder,translator] [--kv bfloat16]   (make bench-quant)

Each model is loaded in fp32 and in every mode (`quantize: int8` / `q8_0` / `q4_1`; "+a8": the
block formats with 8-bit activations, `block_activation_bits: 8`; eager, as the default specs
otherwise are); timed runs alternate between them. Quality is each mode against fp32.
- SmolLM2-135M: greedy decoding tokens/s at batch 1 / 8 / 32 (models.generate, 32 new tokens);
  perplexity on held-out English text (the running text of the translator's 1,000 test sentences,
  which no model here was trained on), and with `--kv` the same through a paged KV cache of each
  dtype named (each window's keys and values stored, rounded to it, then attended, as the engine's
  `kv_cache_dtype` does); the greedy answer to "What is the capital of France?".
- MiniLM + sentiment head: texts/s at batch 1 / 8 / 32 (mixed lengths); on the test sentences, the
  share with the same label as fp32 and the lowest cosine between fp32 and int8 embeddings.
- Translator: beam-4 sentences/s at batch 1 / 8 / 32; chrF of beam 4 on the committed test set
  (models/weights/translator-en-es/test.tsv) for both.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from models import zoo
from models.beam_search import BeamParams, translate_ids
from models.cache.base import KV_DTYPES
from models.cache.paged import PagedKVCache, blocks_for
from models.catalog import BUILTIN_DIR, DEFAULT_SPECS, LoadedModel, load_model
from models.decoding import SamplingParams
from models.generate import generate
from models.inputs import PaddedBatch
from models.machine import machine_info
from models.spec import variant
from models.train.eval_translator import read_test, translate_all

from .bench import mixed_texts

log = logging.getLogger("bench.quant")
TEST_SET = BUILTIN_DIR / "translator-en-es" / "test.tsv"
MODES = ("int8", "q8_0", "q4_1")  # against fp32


def alternate(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each fn, the fns taking turns (one warm-up call each first)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def load_pair(name: str, cache_dir: Path, modes: tuple[str, ...] = MODES) -> dict[str, LoadedModel]:
    """fp32 and each mode of `modes` (models.spec.variant's names, e.g. "q4_1+a8"), by name."""
    return {m: load_model(variant(DEFAULT_SPECS[name], m), cache_dir) for m in ("fp32", *modes)}


def bench_generator(cache_dir: Path, sentences: list[str], quick: bool, rng: random.Random,
                    modes: tuple[str, ...] = MODES, kv: tuple[str, ...] = ()) -> dict[str, Any]:
    lms = load_pair("generator", cache_dir, modes)
    tok = lms["fp32"].tokenizer
    rows = []
    new = 8 if quick else 32
    for b in (1, 8, 32):
        prompts = [tok.encode(" ".join(rng.sample(sentences, 1)), add_special_tokens=False)[:24] for _ in range(b)]
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        with torch.inference_mode():
            t = alternate({k: (lambda lm=lm, p=prompts, sp=params: generate(lm.executor, p, sp)) for k, lm in lms.items()},
                          1 if quick else 3)
        rows.append({"batch": b, **{k: b * new / v for k, v in t.items()}})
        log.info("generator batch %d: %s tok/s", b, {k: round(b * new / v, 1) for k, v in t.items()})
    text = " ".join(sentences[: 40 if quick else len(sentences)])
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                        add_special_tokens=False)
    quality = {}
    for k, lm in lms.items():
        (out,) = generate(lm.executor, [prompt], SamplingParams(max_new_tokens=24))
        quality[k] = {"perplexity": perplexity(lm, ids, window=512), "capital_answer": tok.decode(out.tokens),
                      "perplexity_kv": {d: perplexity(lm, ids, window=512, kv=KV_DTYPES[d]) for d in kv}}
        log.info("generator %s: perplexity %.3f, answer %r", k, quality[k]["perplexity"],
                 quality[k]["capital_answer"])
    return {"speed_tokens_per_s": rows, "quality": quality, "tokens_scored": len(ids)}


@torch.inference_mode()
def perplexity(lm: LoadedModel, ids: list[int], window: int, kv: torch.dtype | None = None) -> float:
    """exp(mean next-token NLL) over `ids`, in non-overlapping windows of `window` tokens, computed as
    prompts are (a generator's prompt weights where it has them); with `kv`, each window through a
    paged KV cache of that dtype (its keys and values stored, then attended as stored)."""
    nll, n = 0.0, 0
    model = lm.prompt_model if lm.prompt_model is not None else lm.model
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start: start + window + 1]])
        if kv is None:
            logits = model(chunk[:, :-1]).float()  # (1, T, V)
        else:
            t = chunk.size(1) - 1
            cache = PagedKVCache.for_model(model.cfg, 1, blocks_for(t) + 1, t, kv)
            logits = model(chunk[:, :-1], cache=cache.view()).float()  # (1, T, V)
        nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        n += chunk.size(1) - 1
    return math.exp(nll / n)


def bench_encoder(cache_dir: Path, sentences: list[str], quick: bool, rng: random.Random,
                  modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    lms = load_pair("encoder", cache_dir, modes)
    tok, pad = lms["fp32"].tokenizer, lms["fp32"].model.cfg.pad_token_id or 0
    rows = []
    for b in (1, 8, 32):
        batch = PaddedBatch.from_token_lists(tok.encode_batch(mixed_texts(b, rng)), pad)
        with torch.inference_mode():
            t = alternate({k: (lambda lm=lm, x=batch: lm.executor.embed(x.ids, x.keep)) for k, lm in lms.items()},
                          3 if quick else 9)
        rows.append({"batch": b, **{k: b / v for k, v in t.items()}})
        log.info("encoder batch %d: %s texts/s", b, {k: round(b / v, 1) for k, v in t.items()})
    texts = sentences[: 128 if quick else len(sentences)]
    pooled, labels = {}, {}
    with torch.inference_mode():
        for k, lm in lms.items():
            vecs, labs = [], []
            for start in range(0, len(texts), 32):
                batch = PaddedBatch.from_token_lists(tok.encode_batch(texts[start: start + 32]), pad)
                v = lm.executor.embed(batch.ids, batch.keep).float()
                vecs.append(v)
                labs += lm.model.head(v).argmax(-1).tolist()
            pooled[k], labels[k] = torch.cat(vecs), labs
    quality = {}
    for k in lms:
        cos = torch.nn.functional.cosine_similarity(pooled["fp32"], pooled[k], dim=-1)
        same = sum(a == b for a, b in zip(labels["fp32"], labels[k], strict=True)) / len(texts)
        quality[k] = {"same_label": same, "min_cosine": cos.min().item(), "mean_cosine": cos.mean().item()}
        log.info("encoder %s: same label %.4f, min cosine %.4f", k, same, cos.min().item())
    return {"speed_texts_per_s": rows, "texts": len(texts), "quality": quality}


def bench_translator(cache_dir: Path, quick: bool, rng: random.Random,
                     modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    import sacrebleu

    lms = load_pair("translator", cache_dir, modes)
    tok, cfg = lms["fp32"].tokenizer, lms["fp32"].model.cfg
    banned = sorted({t for t in (cfg.pad_token_id, cfg.decoder_start_token_id) if t is not None} - {cfg.eos_token_id})
    sources, refs = read_test(TEST_SET)
    rows = []
    for b in (1, 8, 32):
        ids = tok.encode_batch(rng.sample(sources, b))
        with torch.inference_mode():
            t = alternate({k: (lambda lm=lm, src=ids: translate_ids(lm.executor, src, BeamParams(4, 128), banned_ids=banned))
                           for k, lm in lms.items()}, 1 if quick else 3)
        rows.append({"batch": b, **{k: b / v for k, v in t.items()}})
        log.info("translator batch %d: %s sentences/s", b, {k: round(b / v, 1) for k, v in t.items()})
    if quick:
        sources, refs = sources[:64], refs[:64]
    chrf = {}
    with torch.inference_mode():
        for k, lm in lms.items():
            hyps = translate_all(lm.model, tok, sources, beam=4)
            chrf[k] = sacrebleu.corpus_chrf(hyps, [refs]).score
    log.info("translator chrF (beam 4, %d sentences): %s", len(sources), chrf)
    return {"speed_sentences_per_s": rows, "chrf_beam4": chrf, "sentences": len(sources)}


def render(result: dict[str, Any]) -> str:
    first = next(result[k] for k in ("generator", "encoder", "translator") if k in result)
    speed = next(v for k, v in first.items() if k.startswith("speed"))
    modes = [m for m in speed[0] if m not in ("batch", "fp32")]  # a speed row: batch, fp32, then each mode
    lines = [f"CPU: {result['cpu']}; torch {result['torch']}, {result['threads']} threads", "",
             "| model | work | batch | fp32 | " + " | ".join(modes) + " | " + " | ".join(f"{m} / fp32" for m in modes)
             + " |", "|---|---|---:|" + "---:|" * (1 + 2 * len(modes))]
    for model, key, unit in (("SmolLM2-135M", "generator", "greedy decode, tokens/s"),
                             ("MiniLM + head", "encoder", "forward, texts/s"),
                             ("translator", "translator", "beam 4, sentences/s")):
        if key not in result:
            continue
        speed = next(v for k, v in result[key].items() if k.startswith("speed"))
        for r in speed:
            lines.append(f"| {model} | {unit} | {r['batch']} | {r['fp32']:.1f} | "
                         + " | ".join(f"{r[m]:.1f}" for m in modes) + " | "
                         + " | ".join(f"{r[m] / r['fp32']:.2f}x" for m in modes) + " |")

    def row(name: str, measure: str, cell: Callable[[str], str]) -> str:
        return f"| {name} | {measure} | " + " | ".join(cell(m) for m in ["fp32", *modes]) + " |"

    lines += ["", "| model | quality measure | fp32 | " + " | ".join(modes) + " |", "|---|---|---:|" + "---:|" * len(modes)]
    if "generator" in result:
        g = result["generator"]
        lines.append(row("SmolLM2-135M", f"perplexity, {g['tokens_scored']} held-out tokens",
                         lambda m: f"{g['quality'][m]['perplexity']:.3f}"))
        for d in g["quality"]["fp32"].get("perplexity_kv", {}):
            lines.append(row("SmolLM2-135M", f"perplexity, the same, through a {d} KV cache",
                             lambda m, d=d: f"{g['quality'][m]['perplexity_kv'][d]:.3f}"))
        lines.append(row("SmolLM2-135M", "capital of France (greedy)", lambda m: repr(g["quality"][m]["capital_answer"])))
    if "encoder" in result:
        e = result["encoder"]
        lines += [row("MiniLM + head", f"same label as fp32, {e['texts']} texts",
                      lambda m: f"{e['quality'][m]['same_label']:.3f}"),
                  row("MiniLM + head", "embedding cosine to fp32 (min / mean)",
                      lambda m: f"{e['quality'][m]['min_cosine']:.4f} / {e['quality'][m]['mean_cosine']:.4f}")]
    if "translator" in result:
        t = result["translator"]
        lines.append(row("translator", f"chrF, beam 4, {t['sentences']} test sentences",
                         lambda m: f"{t['chrf_beam4'][m]:.2f}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats, tokens and texts (a smoke run)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    p.add_argument("--modes", default=",".join(MODES), help="quantized modes to compare with fp32")
    p.add_argument("--models", default="generator,encoder,translator", help="which default models to run")
    p.add_argument("--kv", default="", help="KV cache dtypes the generator's perplexity is also computed through")
    args = p.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    models = set(args.models.split(","))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cache_dir, rng = zoo.default_cache_dir(), random.Random(0)
    sentences = read_test(TEST_SET)[0]
    machine = machine_info()
    cpu = f"{machine.get('cpu_model', platform.processor())} ({', '.join(machine.get('cpu_flags', [])) or 'no listed flags'})"
    result: dict[str, Any] = {"cpu": cpu, "machine": machine, "torch": torch.__version__,
                              "threads": torch.get_num_threads()}
    if "generator" in models:
        result["generator"] = bench_generator(cache_dir, sentences, args.quick, rng, modes,
                                              tuple(d for d in args.kv.split(",") if d))
    if "encoder" in models:
        result["encoder"] = bench_encoder(cache_dir, sentences, args.quick, rng, modes)
    if "translator" in models:
        result["translator"] = bench_translator(cache_dir, args.quick, rng, modes)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
