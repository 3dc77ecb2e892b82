"""The translator trainer continues a trained checkpoint (--init) on the schedule where it stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.checkpoints.format import load_checkpoint
from models.train.translator import TrainConfig, lr_at, main

TOKENIZER = Path(__file__).parents[2] / "models/weights/translator-en-es/tokenizer.json"
PAIRS = [("Where is the station?", "¿Dónde está la estación?"), ("I love this song!", "¡Amo esta canción!"),
         ("She said nothing.", "Ella no dijo nada."), ("The house is small.", "La casa es pequeña.")] * 6


def test_rewarm_ramps_from_zero_to_the_schedule() -> None:
    plain = TrainConfig(warmup=1000)
    cont = TrainConfig(warmup=1000, init_step=2096, rewarm=200)
    assert lr_at(2096, cont) == 0.0
    assert lr_at(2196, cont) == pytest.approx(lr_at(2196, plain) / 2)
    for step in (2296, 2500, 10_000):
        assert lr_at(step, cont) == lr_at(step, plain)


def test_cool_down_falls_linearly_to_zero_from_the_schedule() -> None:
    plain = TrainConfig(warmup=1000)
    cool = TrainConfig(warmup=1000, decay_from=5000, decay_steps=400)
    for step in (10, 1000, 4999, 5000):
        assert lr_at(step, cool) == lr_at(step, plain)
    assert lr_at(5100, cool) == pytest.approx(lr_at(5000, plain) * 0.75)
    assert lr_at(5300, cool) == pytest.approx(lr_at(5000, plain) * 0.25)
    assert lr_at(5400, cool) == 0.0 and lr_at(6000, cool) == 0.0


def _write_data(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid"):
        (data / f"{split}.tsv").write_text("".join(f"{en}\t{es}\n" for en, es in PAIRS), encoding="utf-8")


def _train(tmp_path: Path, out: str, *extra: str) -> Path:
    main(["--data", str(tmp_path / "data"), "--tokenizer", str(TOKENIZER), "--out", str(tmp_path / out),
          "--d-model", "32", "--d-ff", "64", "--encoder-layers", "1", "--decoder-layers", "1",
          "--batch-tokens", "200", "--warmup", "4", "--eval-steps", "1000", "--threads", "1", *extra])
    return tmp_path / out


def test_init_continues_the_checkpoint_at_its_step(tmp_path: Path) -> None:
    _write_data(tmp_path)
    first = _train(tmp_path, "first", "--max-steps", "3")
    start = load_checkpoint(first / "final")
    second = _train(tmp_path, "second", "--init", str(first / "final"), "--init-step", "3", "--rewarm", "2",
                    "--max-steps", "5")
    state = json.loads((second / "state" / "state.json").read_text())
    assert state["step"] == 5 and state["train"]["init_step"] == 3
    logged = [json.loads(line) for line in (second / "log.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == 5
    # two steps from the first run's weights: moved, but the embeddings are still mostly the first run's
    after = load_checkpoint(second / "final")
    a, b = start.state_dict(), after.state_dict()
    assert not torch.equal(a["encoder.embed.tokens.weight"], b["encoder.embed.tokens.weight"])
    cos = torch.nn.functional.cosine_similarity(a["encoder.embed.tokens.weight"].flatten(),
                                                b["encoder.embed.tokens.weight"].flatten(), dim=0)
    assert cos > 0.9


def test_sigterm_ends_the_run_after_its_step_and_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal mid-run (as `kill` or Ctrl-C on a background training) saves, scores and exports."""
    import signal

    from models.train import translator

    _write_data(tmp_path)
    plain = translator.lr_at

    def lr_at(step: int, tc: TrainConfig) -> float:  # the loop sets each step's rate: signal at step 2
        if step == 2:
            signal.raise_signal(signal.SIGTERM)
        return plain(step, tc)

    monkeypatch.setattr(translator, "lr_at", lr_at)
    before = signal.getsignal(signal.SIGTERM)
    out = _train(tmp_path, "run", "--max-steps", "1000")
    assert json.loads((out / "state" / "state.json").read_text())["step"] == 2
    assert load_checkpoint(out / "final") is not None
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back


def test_cool_down_stops_the_run_at_its_end_and_resumes_where_it_started(tmp_path: Path) -> None:
    _write_data(tmp_path)
    out = _train(tmp_path, "run", "--max-steps", "2")
    _train(tmp_path, "run", "--decay-steps", "4", "--max-minutes", "0")  # starts the cool-down at 2, stops at once
    state = json.loads((out / "state" / "state.json").read_text())
    assert state["train"]["decay_from"] == 2 and state["train"]["decay_steps"] == 4
    _train(tmp_path, "run", "--decay-steps", "4")  # resumed: the same cool-down, not a new one from here
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    state = json.loads((out / "state" / "state.json").read_text())
    assert state["step"] == 6 and state["train"]["decay_from"] == 2
    assert logged[-1]["step"] == 6
