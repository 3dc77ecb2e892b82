"""One engine in its own process: `python -m loadtests.peers.worker ENGINE MODE [PATH]`.

Reads one JSON command per line on stdin and answers one JSON line on stdout:
  {"op": "run", "work": {...}}              -> {"out": ...}   outputs, for the conversion checks
  {"op": "time", "work": {...}, "repeats": n} -> {"s": median seconds of n calls}
Work is {"kind": "encode", "ids": [[...]]}  (or "batches": [ids, ids, ...]: one call per batch) | {"kind": "translate", "ids": [[...]], "beam": k}
| {"kind": "prefill", "ids": [...]} | {"kind": "decode" | "greedy", "ids": [...], "new": n}; token ids
come from our tokenizer, so every engine gets the same input ({"kind": "tokenize" | "detokenize"} asks
our worker for them).

Engines: ours (MODE fp32 | int8 | q8_0 | q4_1, "+compiled" for compiled blocks) for encoder /
translator / generator, onnxruntime (MODE fp32 | int8,
PATH = the .onnx file), ctranslate2 (MODE = its compute type, PATH = the converted model folder).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_NEW = 128


def _threads() -> int:
    return int(os.environ.get("PEERS_THREADS", "2"))


def ours(model_kind: str, mode: str) -> Callable[[dict[str, Any]], Any]:
    import torch

    from models import zoo
    from models.beam_search import BeamParams, translate_ids
    from models.catalog import DEFAULT_SPECS, load_model
    from models.decoding import SamplingParams
    from models.generate import generate
    from models.inputs import PaddedBatch
    from models.spec import variant

    torch.set_num_threads(_threads())
    spec = variant(DEFAULT_SPECS[model_kind], mode)  # e.g. "q4_1+compiled": quantize q4_1, compiled blocks
    lm = load_model(spec, zoo.default_cache_dir())
    model, cfg, steps = lm.model, lm.model.cfg, lm.executor  # steps: on the plan chosen at load, as served
    banned = sorted({t for t in (cfg.pad_token_id, getattr(cfg, "decoder_start_token_id", None)) if t is not None}
                    - {getattr(cfg, "eos_token_id", None)})

    @torch.inference_mode()
    def run(work: dict[str, Any]) -> Any:
        if work["kind"] == "encode":
            batch = PaddedBatch.from_token_lists(work["ids"], cfg.pad_token_id or 0)
            emb = steps.embed(batch.ids, batch.keep)  # (B, C)
            return {"embedding": emb.float().tolist(), "label": model.head(emb).argmax(-1).tolist()}
        if work["kind"] == "tokenize":  # {"text": ...} or {"messages": [...]} (through the chat template)
            text = lm.tokenizer.apply_chat_template(work["messages"]) if "messages" in work else work["text"]
            return {"text": text, "ids": lm.tokenizer.encode(text, add_special_tokens=False)}
        if work["kind"] == "detokenize":
            return lm.tokenizer.decode(work["ids"])
        if work["kind"] == "translate":
            return translate_ids(steps, work["ids"], BeamParams(work["beam"], MAX_NEW), banned_ids=banned)
        new = 1 if work["kind"] == "prefill" else work["new"]
        (out,) = generate(steps, [work["ids"]], SamplingParams(max_new_tokens=new, ignore_eos=work["kind"] != "greedy"))
        return out.tokens
    return run


def onnxruntime_engine(path: str) -> Callable[[dict[str, Any]], Any]:
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = _threads(), 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

    def run(work: dict[str, Any]) -> Any:
        rows = work["ids"]
        width = max(map(len, rows))
        ids = np.zeros((len(rows), width), dtype=np.int64)
        keep = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)], keep[i, : len(r)] = r, 1
        emb, logits = session.run(None, {"ids": ids, "keep": keep})
        return {"embedding": emb.tolist(), "label": logits.argmax(-1).tolist()}
    return run


def ctranslate2_engine(path: str, mode: str) -> Callable[[dict[str, Any]], Any]:
    """mode: "<compute type>:<backend>", backend mkl or onednn (CTranslate2's two CPU backends: which
    is faster depends on the CPU and the compute type, so the benchmark times both; its own default is
    MKL on Intel CPUs, oneDNN elsewhere)."""
    compute_type, _, backend = mode.partition(":")
    if backend:
        os.environ["CT2_USE_MKL"] = "1" if backend == "mkl" else "0"
    import ctranslate2

    vocab = json.loads(Path(path, "shared_vocabulary.json").read_text())
    index = {t: i for i, t in enumerate(vocab)}
    config = json.loads(Path(path, "config.json").read_text())
    banned = [[config["decoder_start_token"]]]  # ours bans the pad/start token from the output
    tr = ctranslate2.Translator(path, device="cpu", compute_type=compute_type, intra_threads=_threads(),
                                inter_threads=1)

    def run(work: dict[str, Any]) -> Any:
        src = [[vocab[i] for i in row] for row in work["ids"]]
        # patience=2 is transformers' (and our) stopping rule: finish once n hypotheses are final and
        # no running beam can beat them; CTranslate2's default stops at the first n finished.
        res = tr.translate_batch(src, beam_size=work["beam"], patience=2 if work["beam"] > 1 else 1,
                                 max_decoding_length=MAX_NEW, suppress_sequences=banned,
                                 return_scores=False)
        return [[index[t] for t in r.hypotheses[0]] for r in res]
    return run


def main() -> None:
    engine, mode, *rest = sys.argv[1:]
    if engine.startswith("ours-"):
        run = ours(engine.removeprefix("ours-"), mode)
    elif engine == "onnxruntime":
        run = onnxruntime_engine(rest[0])
    elif engine == "ctranslate2":
        run = ctranslate2_engine(rest[0], mode)
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    one = run

    def run(work: dict[str, Any]) -> Any:  # {"batches": [...]}: one call per batch, in turn
        if "batches" in work:
            return [one({**work, "ids": batch}) for batch in work["batches"]]
        return one(work)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "run":
            reply: dict[str, Any] = {"out": run(cmd["work"])}
        else:
            times = []
            for _ in range(cmd["repeats"]):
                start = time.perf_counter()
                run(cmd["work"])
                times.append(time.perf_counter() - start)
            reply = {"s": statistics.median(times)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
