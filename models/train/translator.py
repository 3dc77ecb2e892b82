"""Train the en->es translator from scratch with the original Transformer recipe.

    python -m models.train.translator --data data/translation --out runs/translator \
        --tokenizer models/weights/translator-en-es/tokenizer.json --max-minutes 100

Recipe (Vaswani et al. 2017): post-norm encoder-decoder, sinusoidal positions, tied embeddings,
dropout 0.1, label smoothing 0.1, Adam(0.9, 0.98, 1e-9), linear warmup then inverse-square-root
decay. Batches hold about --batch-tokens target tokens of similar length. Fixed seeds.

Resumable: every --save-minutes the model and optimizer are written to <out>/state/ as safetensors
+ a weights-only torch file + JSON, and a rerun with the same --out continues. SIGTERM or Ctrl-C
ends a run after its current step as --max-minutes does (state saved, model scored and exported).
With --init DIR --init-step N a trained checkpoint is continued: the schedule resumes at step N
with a fresh Adam, its rate ramped up again over --rewarm steps. --decay-steps K ends a run with a
cool-down: from --decay-from S (default: the step the run starts at) the rate falls linearly from
the schedule's rate at S to zero at S + K, where the run stops. Every --eval-steps the validation
loss and greedy chrF on a validation slice are logged to
<out>/log.jsonl (the loss curve in docs/models.md is drawn from it). The final model is written
in our checkpoint format to <out>/final/ (and copied to --export if given).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from models.beam_search import BeamParams, translate_ids
from models.checkpoints.format import load_checkpoint, save_checkpoint
from models.config import Seq2SeqConfig
from models.seq2seq import Seq2Seq

log = logging.getLogger("train.translator")

EOS, UNK, PAD = 0, 1, 2  # fixed by models/train/translation_tokenizer.py


@dataclass(frozen=True)
class TrainConfig:
    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    encoder_layers: int = 4
    decoder_layers: int = 3
    dropout: float = 0.1
    label_smoothing: float = 0.1
    batch_tokens: int = 3000
    warmup: int = 1500
    lr_factor: float = 1.0
    max_len: int = 64  # tokens per side; longer pairs are skipped
    seed: int = 0
    init_step: int = 0  # the schedule's step of the --init weights (0: trained from scratch)
    rewarm: int = 0  # steps over which the learning rate ramps up again after --init (a fresh Adam)
    decay_from: int = 0  # with decay_steps: the step the linear cool-down to zero starts at
    decay_steps: int = 0  # length of the cool-down (0: none, the inverse-square-root decay goes on)


def model_config(tc: TrainConfig, vocab_size: int) -> Seq2SeqConfig:
    return Seq2SeqConfig(
        vocab_size=vocab_size, d_model=tc.d_model, n_heads=tc.n_heads, d_ff=tc.d_ff,
        n_layers=tc.encoder_layers, decoder_layers=tc.decoder_layers, max_positions=256,
        position="sinusoidal", norm="layernorm", prenorm=False, final_norm=False, activation="relu",
        dropout=tc.dropout, scale_embeddings=True, tie_embeddings=True, final_logits_bias=True,
        pad_token_id=PAD, decoder_start_token_id=PAD, eos_token_id=EOS,
    )


def read_pairs(path: Path) -> list[tuple[str, str]]:
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        en, _, es = line.partition("\t")
        if en and es:
            pairs.append((en, es))
    return pairs


def encode_pairs(tokenizer, pairs: list[tuple[str, str]], max_len: int) -> list[tuple[list[int], list[int]]]:
    src = tokenizer.encode_batch([en for en, _ in pairs])
    tgt = tokenizer.encode_batch([es for _, es in pairs])
    out = []
    for s, t in zip(src, tgt, strict=True):
        if len(s.ids) <= max_len and len(t.ids) <= max_len:
            out.append((s.ids, t.ids))
    return out


def make_batches(data: list[tuple[list[int], list[int]]], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Index batches of similar lengths, about batch_tokens target tokens (padded) each, shuffled."""
    order = sorted(range(len(data)), key=lambda i: (len(data[i][1]), len(data[i][0]), rng.random()))
    batches, cur, longest = [], [], 0
    for i in order:
        longest_if = max(longest, len(data[i][1]), len(data[i][0]))
        if cur and longest_if * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest_if = [], max(len(data[i][1]), len(data[i][0]))
        cur.append(i)
        longest = longest_if
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(data, idx: list[int]) -> tuple[torch.Tensor, ...]:
    """src (B, S), src_keep (B, S), tgt_in (B, T), labels (B, T) with -100 on padding."""
    srcs = [data[i][0] for i in idx]
    tgts = [data[i][1] for i in idx]
    s_len, t_len = max(map(len, srcs)), max(map(len, tgts))
    src = torch.full((len(idx), s_len), PAD, dtype=torch.long)
    tgt_in = torch.full((len(idx), t_len), PAD, dtype=torch.long)
    labels = torch.full((len(idx), t_len), -100, dtype=torch.long)
    for r, (s, t) in enumerate(zip(srcs, tgts, strict=True)):
        src[r, : len(s)] = torch.tensor(s)
        tgt_in[r, : len(t)] = torch.tensor([PAD] + t[:-1])  # decoder starts from PAD, as Marian does
        labels[r, : len(t)] = torch.tensor(t)
    return src, src != PAD, tgt_in, labels


def lr_at(step: int, tc: TrainConfig) -> float:
    """The schedule's rate; after --init it continues from init_step, ramped up over `rewarm` steps;
    in a cool-down it falls linearly from the rate at decay_from to zero at decay_from + decay_steps."""
    if tc.decay_steps and step > tc.decay_from:
        left = max(0.0, 1.0 - (step - tc.decay_from) / tc.decay_steps)
        return left * lr_at(tc.decay_from, replace(tc, decay_steps=0))
    ramp = min(1.0, max(step - tc.init_step, 0) / tc.rewarm) if tc.rewarm else 1.0
    step = max(step, 1)
    return ramp * tc.lr_factor * tc.d_model**-0.5 * min(step**-0.5, step * tc.warmup**-1.5)


def evaluate(model: Seq2Seq, data, tokenizer, refs: list[str]) -> dict[str, float]:
    import sacrebleu

    model.eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        idx = list(range(len(data)))
        for start in range(0, len(idx), 64):
            src, keep, tgt_in, labels = collate(data, idx[start: start + 64])
            logits = model(src, keep, tgt_in, tgt_in != PAD)
            total += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                     reduction="sum").item()
            count += int((labels != -100).sum())
        n = min(200, len(data))
        hyps = []
        for start in range(0, n, 50):
            out = translate_ids(model, [data[i][0] for i in range(start, min(n, start + 50))],
                                BeamParams(beam_size=1, max_new_tokens=80), banned_ids=[PAD])
            hyps.extend(tokenizer.decode_batch(out, skip_special_tokens=True))
    model.train()
    chrf = sacrebleu.corpus_chrf(hyps, [refs[:n]]).score
    return {"val_loss": total / max(count, 1), "val_chrf_greedy": chrf}


def save_state(out: Path, model, opt, step: int, epoch: int, pos: int, tc: TrainConfig) -> None:
    tmp = out / "state.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "decoder.embed.tokens.weight"},
              tmp / "model.safetensors")
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "epoch": epoch, "pos": pos, "train": tc.__dict__}))
    final = out / "state"
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def load_state(out: Path, model, opt) -> tuple[int, int, int]:
    """(step, epoch, batches done in that epoch) of the saved state, or zeros."""
    state = out / "state"
    if not (state / "state.json").exists():
        return 0, 0, 0
    weights = load_file(state / "model.safetensors")
    weights["decoder.embed.tokens.weight"] = weights["encoder.embed.tokens.weight"]
    model.load_state_dict(weights)
    opt.load_state_dict(torch.load(state / "optimizer.pt", weights_only=True))
    meta = json.loads((state / "state.json").read_text())
    log.info("resumed from step %d (epoch %d)", meta["step"], meta["epoch"])
    return meta["step"], meta["epoch"], meta["pos"]


def _saved_decay_from(out: Path) -> int | None:
    """The step the saved state's cool-down started at, so that a resumed cool-down goes on from it."""
    meta = out / "state" / "state.json"
    if not meta.exists():
        return None
    train = json.loads(meta.read_text()).get("train", {})
    return train["decay_from"] if train.get("decay_steps") else None


class _StopOnSignal:
    """Turns SIGTERM and SIGINT into a request to stop (the run then saves, scores and exports as at
    its deadline); restore() puts the previous handlers back. Only in the main thread."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous = {}


def train(args: argparse.Namespace) -> Path:
    from tokenizers import Tokenizer

    tc = TrainConfig(d_model=args.d_model, d_ff=args.d_ff, encoder_layers=args.encoder_layers,
                     decoder_layers=args.decoder_layers, batch_tokens=args.batch_tokens,
                     warmup=args.warmup, lr_factor=args.lr_factor, seed=args.seed,
                     init_step=args.init_step if args.init else 0, rewarm=args.rewarm if args.init else 0)
    torch.manual_seed(tc.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    data_dir = Path(args.data)
    train_data = encode_pairs(tokenizer, read_pairs(data_dir / "train.tsv"), tc.max_len)
    valid_pairs = read_pairs(data_dir / "valid.tsv")
    valid_data = encode_pairs(tokenizer, valid_pairs, 10_000)
    valid_refs = [es for _, es in valid_pairs]
    log.info("train pairs %d, valid pairs %d", len(train_data), len(valid_data))

    cfg = model_config(tc, tokenizer.get_vocab_size())
    model = Seq2Seq(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=lr_at(tc.init_step + 1, tc), betas=(0.9, 0.98), eps=1e-9)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    step, epoch, pos = load_state(out, model, opt)
    if step == 0 and args.init:  # continue a trained model with a fresh optimizer
        model.load_state_dict(load_checkpoint(args.init).state_dict())
        step = tc.init_step
        log.info("initialised from %s at schedule step %d (re-warm over %d steps)", args.init, step, tc.rewarm)
    max_steps = args.max_steps
    if args.decay_steps:  # the cool-down starts where asked, else where the saved one did, else here
        started = args.decay_from if args.decay_from is not None else _saved_decay_from(out)
        tc = replace(tc, decay_from=step if started is None else started, decay_steps=args.decay_steps)
        max_steps = tc.decay_from + tc.decay_steps
        log.info("cool-down from step %d (rate %.2e) to zero at step %d", tc.decay_from, lr_at(tc.decay_from, tc),
                 max_steps)
    model.train()
    deadline = time.monotonic() + args.max_minutes * 60
    stop = _StopOnSignal()  # SIGTERM / SIGINT: end after the step in progress, as at the deadline
    last_save = time.monotonic()
    logf = (out / "log.jsonl").open("a")
    bar = tqdm(total=max_steps or None, initial=step, desc="train", unit="step", mininterval=5)
    try:
        done = False
        while not done:
            batches = make_batches(train_data, tc.batch_tokens, random.Random(tc.seed + epoch))
            for idx in batches[pos:]:
                pos += 1
                src, keep, tgt_in, labels = collate(train_data, idx)
                logits = model(src, keep, tgt_in, tgt_in != PAD)  # (B, T, V)
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                       label_smoothing=tc.label_smoothing)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                step += 1
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, tc)
                opt.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", epoch=epoch)
                if step % 50 == 0:
                    logf.write(json.dumps({"step": step, "epoch": epoch, "train_loss": loss.item(),
                                           "lr": lr_at(step, tc), "time": time.time()}) + "\n")
                    logf.flush()
                if step % args.eval_steps == 0:
                    metrics = evaluate(model, valid_data, tokenizer, valid_refs)
                    log.info("step %d: %s", step, metrics)
                    logf.write(json.dumps({"step": step, "epoch": epoch, **metrics, "time": time.time()}) + "\n")
                    logf.flush()
                if time.monotonic() - last_save > args.save_minutes * 60:
                    save_state(out, model, opt, step, epoch, pos, tc)
                    last_save = time.monotonic()
                if time.monotonic() > deadline or (max_steps and step >= max_steps) or stop.requested:
                    done = True
                    break
            else:
                epoch, pos = epoch + 1, 0
    finally:
        stop.restore()
    bar.close()
    if stop.requested:
        log.info("stopped by a signal at step %d: saving, scoring and exporting", step)
    save_state(out, model, opt, step, epoch, pos, tc)
    metrics = evaluate(model, valid_data, tokenizer, valid_refs)
    logf.write(json.dumps({"step": step, "epoch": epoch, **metrics, "time": time.time()}) + "\n")
    logf.close()
    log.info("final step %d: %s", step, metrics)
    model.eval()
    final = out / "final"
    save_checkpoint(model, final)
    if args.export:
        export = Path(args.export)
        export.mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "config.json"):
            shutil.copy(final / name, export / name)
    return final


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/translation")
    p.add_argument("--tokenizer", default="models/weights/translator-en-es/tokenizer.json")
    p.add_argument("--out", default="runs/translator")
    p.add_argument("--export", default=None, help="also copy the final checkpoint here")
    p.add_argument("--max-minutes", type=float, default=120.0)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--eval-steps", type=int, default=1000)
    p.add_argument("--save-minutes", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--init", default=None,
                   help="start from this checkpoint (our format, same shapes) instead of random weights")
    p.add_argument("--init-step", type=int, default=0, help="the schedule step the --init weights were trained to")
    p.add_argument("--rewarm", type=int, default=200, help="with --init: ramp the rate up over this many steps")
    p.add_argument("--decay-steps", type=int, default=0,
                   help="end with a linear cool-down of the rate to zero over this many steps (the run stops there)")
    p.add_argument("--decay-from", type=int, default=None,
                   help="the step the cool-down starts at (default: where a resumed cool-down started, "
                   "else the step this run starts or resumes at)")
    defaults = TrainConfig()
    p.add_argument("--d-model", type=int, default=defaults.d_model)
    p.add_argument("--d-ff", type=int, default=defaults.d_ff)
    p.add_argument("--encoder-layers", type=int, default=defaults.encoder_layers)
    p.add_argument("--decoder-layers", type=int, default=defaults.decoder_layers)
    p.add_argument("--batch-tokens", type=int, default=defaults.batch_tokens)
    p.add_argument("--warmup", type=int, default=defaults.warmup)
    p.add_argument("--lr-factor", type=float, default=defaults.lr_factor)
    p.add_argument("--seed", type=int, default=defaults.seed)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(args)


if __name__ == "__main__":
    main()
