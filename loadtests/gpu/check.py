"""The prepared GPU check: one command that measures what a lent GPU gives (`make gpu-check`).

    python -m loadtests.gpu.check [--out DIR] [--tiny] [--device cuda|cpu] [--budget-s 420]

Needs only PyTorch, transformers, tokenizers and numpy (what the GPU machine has: no Ray, no
FastAPI, no weights): every model has random weights at the real shapes of our defaults (MiniLM,
SmolLM2-135M, a ~1B Llama, a Marian-sized translator), built by `transformers` and imported into
ours, so both run the same weights. Writes DIR/gpu-check.json and DIR/gpu-check.md:

1. environment: GPU, memory, driver, torch / CUDA versions;
2. correctness: ours vs transformers in float32 (relative error, <= 1e-4 to pass) and bfloat16
   (relative error, greedy-token agreement over 16 steps); padded = alone, cached = uncached; the
   same request alone and among 31 others in the continuous-batching engine (service/engine, no
   Ray): identical tokens, and whether bitwise;
3. throughput: the engine at 1, 32 and 256 concurrent sequences (output tok/s, step time, % of the
   memory bandwidth at batch 1 for the model's bytes per token) next to transformers' static
   batching `generate`; the encoder (texts/s at batch 1/32/256) and the translator (sentences/s,
   beam 4), each next to transformers;
4. adapters: LoRA adapters on the device (bf16 factors' products by torch): a batch mixing three
   adapters and the bare model against copies with each merged into the weights (float32), a request
   alone and among 31 others over 8 adapters (bfloat16), output tok/s at 32 sequences bare and over
   8 adapters.

Every section records its own error instead of stopping the run, and the run stops starting new
measurements once --budget-s is spent. `--tiny` shrinks every shape and count so that `make test`
runs it on CPU in seconds (tests/loadtests/test_gpu_check.py): it cannot rot unseen.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Peak memory bandwidth (GB/s) by GPU name, for "% of the bandwidth limit" at batch 1.
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0}
SHAPES = {  # transformers config kwargs at our defaults' real shapes
    "minilm": dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                   intermediate_size=1536, max_position_embeddings=512),
    "smollm2": dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536, max_position_embeddings=2048,
                    tie_word_embeddings=True, rope_theta=100000.0),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=4096,
                     tie_word_embeddings=True, rope_theta=500000.0),
    "marian": dict(vocab_size=32000, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                   decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                   max_position_embeddings=512, scale_embedding=True, pad_token_id=0, eos_token_id=1,
                   decoder_start_token_id=0),
}
TINY = {
    "minilm": dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   max_position_embeddings=128),
    "smollm2": dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=96, max_position_embeddings=256, tie_word_embeddings=True),
    "marian": dict(vocab_size=300, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
                   scale_embedding=True, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
}


class Run:
    """The run's clock, its device and sizes, and the results collected so far."""

    def __init__(self, device: str, tiny: bool, budget_s: float, out: Path | None = None,
                 only: set[str] | None = None) -> None:
        self.device, self.tiny, self.budget_s, self.out = torch.device(device), tiny, budget_s, out
        self.only = only or set()  # run only these sections (and the environment); empty: all
        self.started = time.perf_counter()
        self.results: dict[str, Any] = {"tiny": tiny, "device": device}
        self.shapes = TINY if tiny else SHAPES
        self.concurrency = (1, 4, 8) if tiny else (1, 32, 256)
        self.new_tokens = 8 if tiny else 64

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def section(self, name: str, fn: Callable[[Run], Any]) -> None:
        if self.only and name not in self.only | {"environment"}:
            return
        if self.left_s() <= 0:
            self.results[name] = {"skipped": f"the {self.budget_s:.0f} s budget was spent"}
            return
        t0 = time.perf_counter()
        try:
            self.results[name] = fn(self)
        except Exception as exc:  # one failing section must not cost the others
            self.results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        if isinstance(self.results[name], dict):
            self.results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        if self.out is not None:  # what ran so far survives a run killed at its limit
            self.save()

    def save(self) -> None:
        assert self.out is not None
        self.results["total_seconds"] = round(time.perf_counter() - self.started, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu-check.json").write_text(json.dumps(self.results, indent=2))
        (self.out / "gpu-check.md").write_text(markdown(self.results))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


# -- helpers ---------------------------------------------------------------------------------------

def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-12))


def synthetic_tokenizer(vocab_size: int) -> Any:
    """A TextTokenizer over `vocab_size` made-up words (t0 t1 ...): the engine detokenizes with it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from models.text import TextTokenizer

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TextTokenizer(tok)


def timed(run: Run, fn: Callable[[], Any], repeat: int = 3) -> float:
    """Median seconds of fn() (after one warm-up call), synchronized."""
    fn()
    run.sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        run.sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def padded_batch(run: Run, vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), t), generator=g)  # (B, T)
    keep = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    return ids.masked_fill(~keep, 0).to(run.device), keep.to(run.device)


def kv_mib(model: Any, sequences: int, tokens: int) -> float:
    """A KV pool just big enough for `sequences` of `tokens` (with a margin): the engine allocates its
    whole budget at once, so a generous fixed budget would take the card's memory for nothing."""
    cfg, item = model.cfg, next(model.parameters()).element_size()
    per_token = 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * item
    return max(16.0, 1.25 * sequences * tokens * per_token / 2**20)


def free_device(run: Run) -> None:
    import gc

    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()


def hf_decoder(run: Run, shape: str) -> tuple[Any, Any]:
    """A random transformers Llama at `shape` and ours with the same weights, on the device, float32."""
    import transformers as hf

    from models.checkpoints import llama
    from models.projections.fuse import fuse_projections

    torch.manual_seed(0)
    ref = hf.LlamaForCausalLM(hf.LlamaConfig(**run.shapes[shape], attn_implementation="sdpa")).eval()
    ours = fuse_projections(llama.from_hf(ref.config.to_dict(), ref.state_dict()))  # as models.catalog serves it
    return ref.to(run.device), ours.to(run.device).eval()


# -- sections --------------------------------------------------------------------------------------

def environment(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                           "platform": platform.platform()}
    if run.device.type == "cuda":
        props = torch.cuda.get_device_properties(run.device)
        out |= {"gpu": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}"}
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
        out["copy_gb_s"] = copy_bandwidth(run)
    return out


def copy_bandwidth(run: Run) -> float:
    """A 4 GiB device-to-device copy: GB/s of bytes read plus written, the ceiling decode is measured against."""
    src = torch.randn(2**29, device=run.device, dtype=torch.bfloat16)  # 1 GiB
    src = torch.cat([src, src, src, src])  # 4 GiB
    dst = torch.empty_like(src)
    size = src.numel() * src.element_size()
    return round(2 * size / timed(run, lambda: dst.copy_(src), repeat=5) / 1e9, 1)


def correctness(run: Run) -> dict[str, Any]:
    import transformers as hf

    from models.checkpoints import bert, marian
    from models.decoding import SamplingParams
    from models.generate import generate

    out: dict[str, Any] = {}
    lengths = [11, 7, 3] if run.tiny else [64, 40, 9]
    # encoder
    torch.manual_seed(0)
    ref = hf.BertModel(hf.BertConfig(**run.shapes["minilm"], attn_implementation="sdpa")).eval()
    enc = bert.from_hf(ref.config.to_dict(), ref.state_dict()).to(run.device).eval()
    ref = ref.to(run.device)
    ids, keep = padded_batch(run, run.shapes["minilm"]["vocab_size"], lengths)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=keep.long()).last_hidden_state
        got = enc(ids, keep)
        alone = enc(ids[2:, :lengths[2]], keep[2:, :lengths[2]])
    out["encoder_fp32_rel_err"] = rel_err(got[keep], want[keep])
    out["encoder_padded_eq_alone"] = rel_err(got[2, :lengths[2]], alone[0])
    # decoder
    ref, dec = hf_decoder(run, "smollm2")
    vocab = run.shapes["smollm2"]["vocab_size"]
    ids, keep = padded_batch(run, vocab, lengths)
    with torch.no_grad():
        pos = (keep.long().cumsum(-1) - 1).clamp(min=0)
        want = ref(input_ids=ids, attention_mask=keep.long(), position_ids=pos).logits
        got = dec(ids, keep)
    out["decoder_fp32_rel_err"] = rel_err(got[keep], want[keep])
    prompts = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    steps = 16
    fp32 = [g.tokens for g in generate(dec, prompts, SamplingParams(max_new_tokens=steps, ignore_eos=True))]
    with torch.no_grad():  # cached = uncached: greedy through the cache equals argmax of full recomputation
        full = torch.tensor([prompts[0] + fp32[0]], device=run.device)
        argmax = dec(full)[0, len(prompts[0]) - 1:-1].argmax(-1).tolist()
    out["decoder_cached_eq_uncached"] = argmax == fp32[0]
    bf16 = dec.to(torch.bfloat16)
    ref_bf16 = ref.to(torch.bfloat16)
    with torch.no_grad():
        out["decoder_bf16_rel_err"] = rel_err(bf16(ids, keep)[keep],
                                              ref_bf16(input_ids=ids, attention_mask=keep.long(),
                                                       position_ids=pos).logits[keep])
    got_bf16 = [g.tokens for g in generate(bf16, prompts, SamplingParams(max_new_tokens=steps, ignore_eos=True))]
    agree = [sum(a == b for a, b in zip(x, y, strict=True)) / steps for x, y in zip(got_bf16, fp32, strict=True)]
    out["decoder_bf16_greedy_agreement_vs_fp32"] = round(sum(agree) / len(agree), 3)
    out |= alone_vs_among(run, bf16, vocab)
    del ref, ref_bf16, dec, bf16
    # encoder-decoder
    torch.manual_seed(0)
    ref = hf.MarianMTModel(hf.MarianConfig(**run.shapes["marian"], attn_implementation="sdpa")).eval()
    mt = marian.from_hf(ref.config.to_dict(), ref.state_dict()).to(run.device).eval()
    ref = ref.to(run.device)
    src, src_keep = padded_batch(run, run.shapes["marian"]["vocab_size"], lengths)
    tgt, tgt_keep = padded_batch(run, run.shapes["marian"]["vocab_size"], [5, 3, 2], seed=1)
    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=src_keep.long(), decoder_input_ids=tgt,
                   decoder_attention_mask=tgt_keep.long()).logits
        got = mt(src, src_keep, tgt, tgt_keep)
    out["seq2seq_fp32_rel_err"] = rel_err(got[tgt_keep], want[tgt_keep])
    out["pass_fp32"] = all(out[k] <= 1e-4 for k in ("encoder_fp32_rel_err", "decoder_fp32_rel_err",
                                                     "seq2seq_fp32_rel_err")) and out["encoder_padded_eq_alone"] <= 1e-4
    return out


def alone_vs_among(run: Run, model: Any, vocab: int) -> dict[str, Any]:
    """One greedy request alone in the engine, then among 31 others: the same tokens? Through the
    engine's default decode steps (captured graphs on CUDA), and the 32 through graphs vs eager steps."""
    from models.decoding import SamplingParams
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine

    tok = synthetic_tokenizer(vocab)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 40, (32,), generator=g)]
    params = SamplingParams(max_new_tokens=run.new_tokens, ignore_eos=True)

    def answers(batch: list[list[int]], graphs: bool | None = None) -> list[list[int]]:
        engine = GenerationEngine(model, tok, EngineConfig(max_running=32, kv_cache_mib=kv_mib(model, 32, 256),
                                                           max_total_tokens=256, max_new_tokens=128, max_queued=64,
                                                           decode_graphs=graphs))
        handles = [engine.submit(p, params) for p in batch]
        while any(not h._done for h in handles) and (engine.stats().running or engine.stats().waiting):
            engine.step()
        return [list(h.result_sync(timeout=60).token_ids) for h in handles]

    graphs = True if run.tiny else None  # the tiny CPU mode: the padded steps, eagerly
    alone = answers(prompts[:1], graphs)[0]
    among = answers(prompts, graphs)
    eager = answers(prompts, graphs=False)
    same = sum(a == b for x, y in zip(among, eager, strict=True) for a, b in zip(x, y, strict=True))
    return {"engine_alone_eq_among_31_bf16": alone == among[0],
            "engine_graphs_eq_eager_tokens_bf16": f"{same}/{sum(map(len, eager))}"}


def engine_decode(run: Run, model: Any, tok: Any, prompts: list[list[int]], graphs: bool,
                  ahead: bool = True) -> dict[str, float]:
    """Decode `prompts` to run.new_tokens each in the engine: tok/s and ms per step past the first
    step, and the seconds capturing the decode-step graphs took (before the clock starts). `ahead`:
    with graphs, each step launched before the previous one's tokens are handed out."""
    from models.decoding import SamplingParams
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine

    n = len(prompts)
    engine = GenerationEngine(model, tok, EngineConfig(max_running=n, kv_cache_mib=kv_mib(model, n, 256),
                                                       max_total_tokens=256, max_new_tokens=200, max_queued=n,
                                                       prefill_tokens=16384, decode_graphs=graphs,
                                                       decode_ahead=ahead))
    t0 = time.perf_counter()
    captured = engine.capture_graphs()
    capture_s = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=run.new_tokens, ignore_eos=True)
    handles = [engine.submit(p, params) for p in prompts]
    engine.step()  # admission and the first decode step
    run.sync()
    t0, steps = time.perf_counter(), 0
    while engine.stats().running:
        engine.step()
        steps += 1
    run.sync()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(h.result_sync(timeout=60).token_ids) for h in handles) - 2 * n  # past the first step
    del engine, handles
    free_device(run)
    return {"tok_s": tokens / elapsed, "step_ms": 1e3 * elapsed / max(steps, 1), "graphs": captured,
            "capture_s": capture_s}


def engine_throughput(run: Run, shape: str) -> dict[str, Any]:
    """Output tok/s of the engine at each concurrency, and of transformers' static batching generate."""
    ref, ours = hf_decoder(run, shape)
    dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
    ours, ref = ours.to(dtype), ref.to(dtype)
    vocab = run.shapes[shape]["vocab_size"]
    tok = synthetic_tokenizer(vocab)
    weight_bytes = streamed_bytes(ours)
    rows: list[dict[str, Any]] = []

    graphs = run.device.type == "cuda"
    for n in run.concurrency:
        if run.left_s() <= 0:
            break
        prompts = [[3 + (i * 7 + j) % (vocab - 3) for j in range(32)] for i in range(n)]
        fast = engine_decode(run, ours, tok, prompts, graphs or run.tiny)  # tiny CPU mode: padded steps, eagerly
        eager = engine_decode(run, ours, tok, prompts, False)
        serial = engine_decode(run, ours, tok, prompts, graphs or run.tiny, ahead=False)
        row = {"sequences": n, "ours_tok_s": round(fast["tok_s"], 1), "ours_step_ms": round(fast["step_ms"], 2),
               "graphs": fast["graphs"], "capture_s": round(fast["capture_s"], 1),
               "no_ahead_tok_s": round(serial["tok_s"], 1), "no_ahead_step_ms": round(serial["step_ms"], 2),
               "eager_tok_s": round(eager["tok_s"], 1), "eager_step_ms": round(eager["step_ms"], 2)}
        ids = torch.tensor(prompts, device=run.device)
        with torch.no_grad():
            t_hf = timed(run, lambda ids=ids: ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                           max_new_tokens=run.new_tokens, min_new_tokens=run.new_tokens,
                                                           pad_token_id=0), repeat=1)
        row["transformers_tok_s"] = round(n * run.new_tokens / t_hf, 1)
        row["ratio"] = round(row["ours_tok_s"] / row["transformers_tok_s"], 2)
        if n == 1:
            gbps = weight_bytes / (fast["step_ms"] / 1e3) / 1e9
            name = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else ""
            peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
            row["weights_gb_s"] = round(gbps, 1)
            row["bandwidth_pct"] = round(100 * gbps / peak, 1) if peak else None
            copy = run.results.get("environment", {}).get("copy_gb_s")
            row["pct_of_measured_copy"] = round(100 * gbps / copy, 1) if copy else None
        rows.append(row)
    return {"dtype": str(dtype).removeprefix("torch."), "weight_bytes": weight_bytes, "rows": rows}


def streamed_bytes(model: Any) -> int:
    """Bytes of weights a decode step reads: parameters and the quantized layers' buffers."""
    from models.projections.int4_tiles import TiledInt4Linear

    tiles = [b for m in model.modules() if isinstance(m, TiledInt4Linear) for b in m.buffers()]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *tiles])


def q4_1_tiles(run: Run, shape: str = "smollm2") -> dict[str, Any]:
    """GGUF's Q4_1 blocks on the int4 tile kernel (`quantize: q4_1` off the CPU; models/projections/int4_tiles.py)
    against the same blocks' values in a dense model of the serving dtype: logits' relative error,
    greedy agreement over 16 steps, the engine alone = among 31 on the tiles, the path a spec takes
    through models.catalog; then engine tok/s and ms per step, tiles vs dense, at 1 and 32 sequences
    (the tiny CPU mode: the kernel's CPU form, float32)."""
    from models.catalog import ModelSpec, load_model
    from models.decoding import SamplingParams
    from models.generate import generate
    from models.projections.int4_tiles import TiledInt4Linear
    from models.projections.quant import quantize, quantize_q4_1_tiles, with_q4_1_values

    cuda = run.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    ref, fp32 = hf_decoder(run, shape)
    del ref
    dense = with_q4_1_values(fp32).to(dtype)
    tiles = (quantize(fp32, "q4_1") if cuda else quantize_q4_1_tiles(fp32)).to(dtype)  # CPU: quantize -> panels
    del fp32
    free_device(run)
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "shape": shape,
                           "tiled_layers": sum(isinstance(m, TiledInt4Linear) for m in tiles.modules())}
    vocab = run.shapes[shape]["vocab_size"]
    lengths = [11, 7, 3] if run.tiny else [64, 40, 9]
    ids, keep = padded_batch(run, vocab, lengths)
    with torch.no_grad():
        out["logits_rel_err_vs_dense"] = rel_err(tiles(ids, keep)[keep], dense(ids, keep)[keep])
    prompts = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    got = [g.tokens for g in generate(tiles, prompts, params)]
    want = [g.tokens for g in generate(dense, prompts, params)]
    out["greedy_agreement_vs_dense"] = round(sum(a == b for x, y in zip(got, want, strict=True)
                                                 for a, b in zip(x, y, strict=True)) / (16 * len(prompts)), 3)
    out |= {k.replace("_bf16", ""): v for k, v in alone_vs_among(run, tiles, vocab).items()}
    if cuda:  # the serving path: quantized in float32 on the device, then cast (models/catalog.py)
        loaded = load_model(ModelSpec(name="q", tasks=("generate",), source="tiny:decoder", quantize="q4_1",
                                      prompt_weights="auto"), Path("/nonexistent"), device=str(run.device),
                            dtype=dtype)
        out["catalog_loads_tiles"] = any(isinstance(m, TiledInt4Linear) for m in loaded.model.modules())
        out["catalog_prompt_speedup"] = loaded.prompt_speedup
    tok = synthetic_tokenizer(vocab)
    rows = []
    for n in (1, 4) if run.tiny else (1, 32):
        if run.left_s() <= 0:
            break
        prompts = [[3 + (i * 7 + j) % (vocab - 3) for j in range(32)] for i in range(n)]
        row: dict[str, Any] = {"sequences": n}
        for name, model in (("tiles", tiles), ("dense", dense)):
            got_run = engine_decode(run, model, tok, prompts, cuda or run.tiny)
            row[f"{name}_tok_s"], row[f"{name}_step_ms"] = round(got_run["tok_s"], 1), round(got_run["step_ms"], 2)
            if n == 1:
                row[f"{name}_weights_gb_s"] = round(streamed_bytes(model) / (got_run["step_ms"] / 1e3) / 1e9, 1)
        row["ratio"] = round(row["tiles_tok_s"] / row["dense_tok_s"], 2)
        rows.append(row)
    out["weight_bytes"] = {"tiles": streamed_bytes(tiles), "dense": streamed_bytes(dense)}
    out["rows"] = rows
    return out


def step_profile(run: Run, shape: str = "smollm2",
                 modes: tuple[tuple[int, bool], ...] = ((1, False), (1, True), (32, True))) -> dict[str, Any]:
    """Where a decode step's time goes (serving dtype): wall ms per step, the device's busy ms per
    step, kernel launches, host synchronisations and copies per step, the host ops and the device
    kernels that cost most, from torch.profiler over 10 engine steps, for each (sequences, graphs)
    of `modes`."""
    from torch.profiler import ProfilerActivity, profile

    from models.decoding import SamplingParams
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine

    _, ours = hf_decoder(run, shape)
    dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
    ours = ours.to(dtype)
    vocab = run.shapes[shape]["vocab_size"]
    tok = synthetic_tokenizer(vocab)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
    rows = []
    for n, graphs in modes if not run.tiny else tuple((min(n, 4), g) for n, g in modes):
        engine = GenerationEngine(ours, tok, EngineConfig(max_running=n, kv_cache_mib=kv_mib(ours, n, 256),
                                                          max_total_tokens=256, max_new_tokens=200, max_queued=n,
                                                          decode_graphs=graphs))
        engine.capture_graphs()
        params = SamplingParams(max_new_tokens=100, ignore_eos=True)
        for i in range(n):
            engine.submit([3 + (i * 7 + j) % (vocab - 3) for j in range(32)], params)
        for _ in range(4):  # admission, then warm decode steps
            engine.step()
        run.sync()
        t0 = time.perf_counter()
        for _ in range(10):
            engine.step()
        run.sync()
        wall = (time.perf_counter() - t0) / 10
        with profile(activities=activities) as prof:
            for _ in range(10):
                engine.step()
            run.sync()
        events = prof.key_averages()

        def count(*names: str, events: Any = events) -> float:
            return sum(e.count for e in events if e.key in names) / 10

        device_us = sum(getattr(e, "self_device_time_total", 0) for e in events if e.device_type.name == "CUDA")
        host = sorted((e for e in events if e.device_type.name == "CPU" and not e.key.startswith("cuda")),
                      key=lambda e: -e.self_cpu_time_total)[:8]
        kernels = sorted((e for e in events if e.device_type.name == "CUDA"),
                         key=lambda e: -getattr(e, "self_device_time_total", 0))[:10]
        rows.append({"sequences": n, "graphs": graphs, "wall_ms_per_step": round(1e3 * wall, 2),
                     "device_busy_ms_per_step": round(device_us / 1e3 / 10, 3),
                     "kernel_launches_per_step": count("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                       "cudaLaunchKernelExC"),
                     "syncs_per_step": count("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
                     "copies_per_step": count("cudaMemcpyAsync", "cudaMemcpy"),
                     "top_host_ops": [f"{e.key} x{e.count // 10} {e.self_cpu_time_total / 10:.0f}us" for e in host],
                     "top_kernels": [f"{e.key[:60]} x{e.count / 10:g} {e.self_device_time_total / 10:.0f}us"
                                     for e in kernels]})
        del engine
        free_device(run)
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows}


def serving_pair(run: Run, shape: str, model_cls: str, config_cls: str, importer: Callable[..., Any]
                 ) -> tuple[Any, Any, torch.dtype]:
    """A random transformers model at `shape`, ours with its weights, both on the device in the serving
    dtype (bfloat16 on CUDA, float32 on CPU)."""
    import transformers as hf

    from models.projections.fuse import fuse_projections

    torch.manual_seed(0)
    ref = getattr(hf, model_cls)(getattr(hf, config_cls)(**run.shapes[shape], attn_implementation="sdpa")).eval()
    ours = fuse_projections(importer(ref.config.to_dict(), ref.state_dict())).eval()  # as models.catalog serves it
    dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
    return ref.to(run.device, dtype), ours.to(run.device, dtype), dtype


def encoder_throughput(run: Run) -> dict[str, Any]:
    from models.checkpoints import bert

    ref, ours, dtype = serving_pair(run, "minilm", "BertModel", "BertConfig", bert.from_hf)
    rows = []
    for b in run.concurrency:
        ids, keep = padded_batch(run, run.shapes["minilm"]["vocab_size"], [16 + (i * 5) % 48 for i in range(b)])
        with torch.no_grad():
            t_ours = timed(run, lambda ids=ids, keep=keep: ours.embed(ids, keep))
            t_ref = timed(run, lambda ids=ids, keep=keep: ref(input_ids=ids, attention_mask=keep.long()))
        rows.append({"batch": b, "ours_texts_s": round(b / t_ours, 1), "transformers_texts_s": round(b / t_ref, 1),
                     "ratio": round(t_ref / t_ours, 2)})
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows}


def translator_throughput(run: Run) -> dict[str, Any]:
    from models.beam_search import BeamParams, translate_ids
    from models.checkpoints import marian

    ref, ours, dtype = serving_pair(run, "marian", "MarianMTModel", "MarianConfig", marian.from_hf)
    vocab, new = run.shapes["marian"]["vocab_size"], (8 if run.tiny else 32)
    rows = []
    for b in run.concurrency[:2] + (run.concurrency[-1] // 4,) if not run.tiny else run.concurrency:
        sources = [[3 + (i * 11 + j) % (vocab - 3) for j in range(12 + i % 8)] + [1] for i in range(b)]
        t_ours = timed(run, lambda s=sources: translate_ids(ours, s, BeamParams(4, new)), repeat=1)
        ids, keep = padded_batch(run, vocab, [len(s) for s in sources])
        with torch.no_grad():
            t_ref = timed(run, lambda ids=ids, keep=keep: ref.generate(
                ids, attention_mask=keep.long(), num_beams=4, max_new_tokens=new, min_new_tokens=new,
                early_stopping=False), repeat=1)
        rows.append({"batch": b, "ours_sentences_s": round(b / t_ours, 1),
                     "transformers_sentences_s": round(b / t_ref, 1), "ratio": round(t_ref / t_ours, 2)})
    return {"dtype": str(dtype).removeprefix("torch."), "beam": 4, "new_tokens": new, "rows": rows}


# -- report ----------------------------------------------------------------------------------------

def merged(model: Any, adapter: Any) -> Any:
    """A copy of an unfused model of ours with `adapter`'s updates merged into its weights (W += s B A):
    the reference an adapter served beside the weights must equal."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for f in adapter.factors:
            weight = out.get_submodule(f.target.path).weight
            weight += (f.scale * f.b.to(weight) @ f.a.to(weight))
    return out


def adapters(run: Run, shape: str = "smollm2") -> dict[str, Any]:
    """LoRA adapters on the device (models/adapters/, the torch products off the CPU): a batch mixing
    three adapters and the bare model gives each row what a copy with that adapter merged into its
    weights gives (float32); in bfloat16, a request on an adapter gives the same tokens alone and among
    31 others spread over 8 adapters; and the engine's output tok/s at 32 sequences bare and over 8
    adapters (the plan refuses captured graphs with adapters: both eager here)."""
    import transformers as hf

    from models.adapters import ResidentAdapters, read_adapter
    from models.adapters.peft import random_llama_factors, save_adapter
    from models.checkpoints import llama
    from models.decoding import SamplingParams
    from models.projections.fuse import fuse_projections
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine, Submission

    torch.manual_seed(0)
    ref = hf.LlamaForCausalLM(hf.LlamaConfig(**run.shapes[shape], attn_implementation="sdpa")).eval()
    plain = llama.from_hf(ref.config.to_dict(), ref.state_dict()).to(run.device).eval()  # unfused: merged into
    served = fuse_projections(llama.from_hf(ref.config.to_dict(), ref.state_dict())).to(run.device).eval()
    del ref
    ranks = (4, 8, 16, 16, 8, 4, 16, 8)
    std = 0.3 if run.tiny else 0.05  # large enough to move greedy tokens at either width
    with tempfile.TemporaryDirectory(prefix="gpu-check-adapters-") as tmp:  # read whole: gone after
        loaded = [read_adapter(save_adapter(Path(tmp) / f"a{i}", random_llama_factors(plain, r, seed=i, std=std), r,
                                            2 * r)) for i, r in enumerate(ranks)]
    resident = ResidentAdapters([served], capacity=8, rank=16)
    slots = [resident.load(a) for a in loaded]
    vocab = run.shapes[shape]["vocab_size"]
    lengths = [9, 7, 5, 3]
    ids, keep = padded_batch(run, vocab, lengths)
    rows = torch.tensor([slots[0], slots[1], slots[2], -1], device=run.device)  # (B,): three adapters, the base
    out: dict[str, Any] = {"dtype": "float32 check, bfloat16 serving", "shape": shape}
    with torch.no_grad():
        mixed = served(ids, keep, adapters=rows)  # (B, T, V)
        errs = []
        for row in range(4):
            model = merged(plain, loaded[row]) if row < 3 else plain
            n = lengths[row]
            errs.append(rel_err(mixed[row, :n], model(ids[row:row + 1, :n])[0]))
    out["mixed_rows_vs_merged_fp32_rel_err"] = max(errs)
    del plain
    free_device(run)
    bf16 = served.to(torch.bfloat16)
    tok = synthetic_tokenizer(vocab)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (32,), generator=g)]
    params = SamplingParams(max_new_tokens=run.new_tokens, ignore_eos=True)

    def answers(jobs: list[tuple[list[int], str | None]]) -> tuple[list[list[int]], float]:
        engine = GenerationEngine(bf16, tok, EngineConfig(max_running=32, kv_cache_mib=kv_mib(bf16, 32, 256),
                                                          max_total_tokens=256, max_new_tokens=128, max_queued=64,
                                                          decode_graphs=False), adapters=resident)
        handles = engine.submit_many([Submission(p, params, adapter=None if a is None else resident.acquire(a))
                                      for p, a in jobs])
        run.sync()
        t0 = time.perf_counter()
        while any(not h._done for h in handles) and (engine.stats().running or engine.stats().waiting):
            engine.step()
        run.sync()
        seconds = time.perf_counter() - t0
        return [list(h.result_sync(timeout=60).token_ids) for h in handles], seconds

    names = [a.name for a in loaded]
    alone, _ = answers([(prompts[0], names[0])])
    among, spread_s = answers([(p, names[i % 8]) for i, p in enumerate(prompts)])
    bare, bare_s = answers([(p, None) for p in prompts])
    out["engine_alone_eq_among_31_on_8_adapters_bf16"] = alone[0] == among[0]
    out["adapters_change_tokens"] = among[1:] != bare[1:]
    tokens = sum(map(len, bare))
    out["rows"] = [{"sequences": len(prompts), "bare_tok_s": round(tokens / bare_s, 1),
                    "8_adapters_tok_s": round(sum(map(len, among)) / spread_s, 1),
                    "ratio": round((sum(map(len, among)) / spread_s) / (tokens / bare_s), 2)}]
    return out


def markdown(results: dict[str, Any]) -> str:
    env = results.get("environment", {})
    lines = [f"# GPU check ({'tiny, ' if results['tiny'] else ''}{results['device']})", "",
             f"GPU: {env.get('gpu', 'none')}, {env.get('memory_gib', '?')} GiB, driver {env.get('driver')}; "
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}", ""]
    corr = results.get("correctness", {})
    lines += ["## Correctness", "", "| check | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in corr.items() if k not in ("traceback", "seconds")]
    for name, key, unit in (("step_profile", "sequences", "per decode step"),
                            ("step_profile_llama_1b", "sequences", "per decode step"), ("generation_smollm2", "sequences", "tok/s"), ("generation_llama_1b", "sequences", "tok/s"),
                            ("q4_1_tiles", "sequences", "tok/s"), ("q4_1_tiles_llama_1b", "sequences", "tok/s"),
                            ("encoder", "batch", "texts/s"), ("translator", "batch", "sentences/s"),
                            ("adapters", "sequences", "output tok/s")):
        if name not in results:
            continue
        section = results[name]
        lines += ["", f"## {name} ({section.get('dtype', '')}, {unit})", ""]
        if "rows" not in section:
            lines.append(f"{section.get('error') or section.get('skipped')}")
            continue
        facts = {k: v for k, v in section.items() if k not in ("rows", "dtype", "seconds", "traceback")}
        if facts:  # a section's own checks and sizes, before its table
            lines += [", ".join(f"{k}: {v}" for k, v in facts.items()), ""]
        cols = list(section["rows"][0]) if section["rows"] else [key]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in section["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and counts (CPU, in make test)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no new measurement starts after this")
    parser.add_argument("--sections", default="", help="comma-separated section names to run (default: all)")
    args = parser.parse_args(argv)
    run = Run(args.device, args.tiny, args.budget_s, args.out, set(filter(None, args.sections.split(","))))
    run.section("environment", environment)
    free_device(run)  # the bandwidth probe's buffers
    run.section("correctness", correctness)
    run.section("generation_smollm2", lambda r: engine_throughput(r, "smollm2"))
    run.section("generation_llama_1b", lambda r: engine_throughput(r, "llama-1b"))
    run.section("q4_1_tiles", q4_1_tiles)
    run.section("q4_1_tiles_llama_1b", lambda r: q4_1_tiles(r, "llama-1b"))
    run.section("step_profile", step_profile)
    run.section("step_profile_llama_1b", lambda r: step_profile(r, "llama-1b", ((1, True), (256, True))))
    run.section("encoder", encoder_throughput)
    run.section("translator", translator_throughput)
    run.section("adapters", adapters)
    run.save()
    print(markdown(run.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
