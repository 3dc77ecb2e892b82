"""Score the translator on its held-out test set and draw its loss curve.

    python -m models.train.eval_translator [--model models/weights/translator-en-es] \
        [--log runs/translator/log.jsonl] [--plot docs/img/translator_loss.png] [--json metrics.json]

BLEU and chrF (sacrebleu) of greedy and beam-4 decoding against the teacher's (Apertium's)
translations of the ~1,000 held-out English sentences, which were never trained on.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from models.beam_search import BeamParams, translate_ids
from models.checkpoints.format import load_checkpoint
from models.text import TextTokenizer

log = logging.getLogger("eval.translator")


def read_test(path: Path) -> tuple[list[str], list[str]]:
    sources, refs = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        en, _, es = line.partition("\t")
        if en and es:
            sources.append(en)
            refs.append(es)
    return sources, refs


def translate_all(model, tokenizer: TextTokenizer, sources: list[str], beam: int, batch: int = 32) -> list[str]:
    pad = model.cfg.pad_token_id
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))  # similar lengths per batch
    out: list[str] = [""] * len(sources)
    for start in range(0, len(order), batch):
        idx = order[start: start + batch]
        ids = tokenizer.encode_batch([sources[i] for i in idx])
        hyps = translate_ids(model, ids, BeamParams(beam_size=beam, max_new_tokens=128),
                             banned_ids=[pad] if pad is not None else [])
        for i, text in zip(idx, tokenizer.decode_batch(hyps), strict=True):
            out[i] = text
    return out


def score(model_dir: Path, test_path: Path, limit: int | None = None) -> dict:
    import sacrebleu

    model = load_checkpoint(model_dir)
    tokenizer = TextTokenizer.from_file(model_dir)
    sources, refs = read_test(test_path)
    if limit:
        sources, refs = sources[:limit], refs[:limit]
    result: dict = {"pairs": len(sources)}
    with torch.inference_mode():
        for name, beam in (("greedy", 1), ("beam4", 4)):
            start = time.perf_counter()
            hyps = translate_all(model, tokenizer, sources, beam)
            seconds = time.perf_counter() - start
            result[name] = {
                "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
                "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2),
                "seconds": round(seconds, 1),
                "examples": [{"en": s, "apertium": r, "ours": h} for s, r, h in
                             list(zip(sources, refs, hyps, strict=True))[:5]],
            }
            log.info("%s: BLEU %.2f chrF %.2f (%.0f s)", name, result[name]["bleu"], result[name]["chrf"], seconds)
    return result


def plot_loss(log_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]

    def series(key: str) -> list[tuple[int, float]]:  # a resumed run logs its redone steps again: the last wins
        return sorted({r["step"]: r[key] for r in rows if key in r}.items())

    train, valid, chrf = series("train_loss"), series("val_loss"), series("val_chrf_greedy")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(*zip(*train, strict=True), label="train loss (label-smoothed)", alpha=0.7)
    if valid:
        ax.plot(*zip(*valid, strict=True), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    if chrf:
        ax2 = ax.twinx()
        ax2.plot(*zip(*chrf, strict=True), "s--", color="tab:green", label="validation chrF (greedy, 200 sent.)")
        ax2.set_ylabel("chrF")
        ax2.legend(loc="center right")
    ax.legend(loc="upper right")
    ax.set_title("en→es translator training")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("models/weights/translator-en-es"))
    p.add_argument("--test", type=Path, default=None, help="default: test.tsv beside the model")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--log", type=Path, default=None, help="training log.jsonl to plot")
    p.add_argument("--plot", type=Path, default=Path("docs/img/translator_loss.png"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.log:
        plot_loss(args.log, args.plot)
    result = score(args.model, args.test or args.model / "test.tsv", args.limit)
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
