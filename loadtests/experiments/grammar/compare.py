"""Which grammar library for structured outputs: llguidance vs xgrammar, on our SmolLM2 tokenizer.

    python -m loadtests.experiments.grammar.compare [--rows 32] [--steps 64]

For one JSON schema, `rows` matchers walk `steps` tokens each (every step: the library fills the
allowed-token bitmask of all rows, then each row consumes a random allowed token, the same walk for
both libraries' seeds), timed per step; the compile time of the schema; and whether a string with
`maxLength` lets a raw control character in (which no JSON parser accepts). xgrammar is not a
dependency of the service (it pulls triton): run this from an environment that has both, e.g. a
venv with `pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi` and a .pth to the service's
site-packages.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from models.machine import machine_info

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def tokenizer_json() -> tuple[str, int, int]:
    from models.catalog import DEFAULT_SPECS, load_model
    from models.zoo import default_cache_dir

    loaded = load_model(DEFAULT_SPECS["generator"], default_cache_dir())
    tok = loaded.tokenizer
    eos = loaded.model.cfg.eos_token_ids[0]
    return tok.tok.to_str(), loaded.model.cfg.vocab_size, eos


def allowed(mask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = ((mask_row[:, None].int() >> torch.arange(32)) & 1).reshape(-1)[:vocab]  # (V,)
    return bits.nonzero()[:, 0].tolist()


BOUNDED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
           "additionalProperties": False}
PREFIX = '{"name": "a'  # then a raw control character, which JSON forbids inside strings


def run_llguidance(tok_json: str, vocab: int, eos: int, rows: int, steps: int, seed: int) -> dict[str, float]:
    import llguidance
    import llguidance.torch as llt

    tok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(rows)]
    compile_s = time.perf_counter() - t0
    executor = llguidance.LLExecutor()
    mask = llt.allocate_token_bitmask(rows, vocab)
    rng, times = random.Random(seed), []
    for _ in range(steps):
        live = [(m, i) for i, m in enumerate(matchers) if not m.is_stopped()]
        if not live:
            break
        t = time.perf_counter()
        llt.fill_next_token_bitmask_par(executor, live, mask)
        times.append(time.perf_counter() - t)
        for m, i in live:
            m.consume_token(rng.choice(allowed(mask[i], vocab)))
    check = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(BOUNDED), defaults={"whitespace_flexible": False}), log_level=0)
    ok = all(check.consume_token(t) for t in tok.tokenize_str(PREFIX))
    raw_control = ok and check.try_consume_tokens(tok.tokenize_bytes(b"\x1f")) > 0
    return {"compile_ms": compile_s * 1e3, "mask_ms": statistics.median(times) * 1e3,
            "p95_ms": sorted(times)[int(0.95 * (len(times) - 1))] * 1e3, "steps": len(times),
            "invalid_json": raw_control}


def run_xgrammar(tok_json: str, vocab: int, eos: int, rows: int, steps: int, seed: int) -> dict[str, float]:
    import xgrammar as xgr
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok_json))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    compile_s = time.perf_counter() - t0
    batch = xgr.BatchGrammarMatcher() if hasattr(xgr, "BatchGrammarMatcher") else None
    mask = xgr.allocate_token_bitmask(rows, vocab)
    rng, times = random.Random(seed), []
    for _ in range(steps):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        t = time.perf_counter()
        if batch is not None:
            batch.batch_fill_next_token_bitmask([matchers[i] for i in live], mask, indices=live)
        else:
            for i in live:
                matchers[i].fill_next_token_bitmask(mask, i)
        times.append(time.perf_counter() - t)
        for i in live:
            matchers[i].accept_token(rng.choice(allowed(mask[i], vocab)))
    check = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(BOUNDED), any_whitespace=False))
    raw_control = check.accept_string(PREFIX) and check.accept_string("\x1f")
    return {"compile_ms": compile_s * 1e3, "mask_ms": statistics.median(times) * 1e3,
            "p95_ms": sorted(times)[int(0.95 * (len(times) - 1))] * 1e3, "steps": len(times),
            "invalid_json": raw_control}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write the table here too")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tok_json, vocab, eos = tokenizer_json()
    cpu = machine_info().get("cpu_model", "unknown CPU")
    lines = [f"{args.rows} rows, up to {args.steps} steps, SmolLM2 tokenizer ({vocab} tokens), CPU: {cpu}", "",
             "| library | compile (ms) | mask, 32 rows, median (ms) | p95 (ms) | steps | "
             "maxLength string takes a raw control character (invalid JSON) |", "|---|---:|---:|---:|---:|---|"]
    for name, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            r = fn(tok_json, vocab, eos, args.rows, args.steps, seed=0)
        except ImportError as exc:
            lines.append(f"| {name} | not installed ({exc.name}) | | | | |")
            continue
        lines.append(f"| {name} | {r['compile_ms']:.1f} | {r['mask_ms']:.3f} | {r['p95_ms']:.3f} | {r['steps']} | "
                     f"{'yes' if r['invalid_json'] else 'no'} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
