"""What the benchmark sends: texts with a realistic, skewed length distribution, generation prompts
and output lengths, Poisson arrival times. Pure Python (no torch), seeded, so every system gets the
same requests in the same order; the locustfile uses it too.

Texts are English sentences from the translator's held-out test set (tweets, news, novels; a few
to 40 words, median 9) and, when present, data/translation/{test,valid}.tsv. Lengths:
- classify/embed: 80 % one sentence, 15 % 2-4 sentences, 5 % 5-10 sentences (long reviews);
- translate: one sentence;
- generate: prompts of 10-200 tokens (log-normal, median 48) made of consecutive sentences, and
  output lengths of 16-128 tokens (log-normal, median 48).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS_FILES = (
    ROOT / "models" / "weights" / "translator-en-es" / "test.tsv",
    ROOT / "data" / "translation" / "test.tsv",
    ROOT / "data" / "translation" / "valid.tsv",
)


def load_sentences(paths: Sequence[Path] = CORPUS_FILES) -> list[str]:
    """Distinct English sentences (first tab-separated column) of the files that exist, in file order."""
    seen: dict[str, None] = {}
    for path in paths:
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                text = line.split("\t", 1)[0].strip()
                if text:
                    seen.setdefault(text)
    if not seen:
        raise FileNotFoundError(f"no sentences found in {[str(p) for p in paths]}")
    return list(seen)


@dataclass(frozen=True)
class LengthMix:
    """Sentences per text: (probability, fewest, most) per bucket."""

    buckets: tuple[tuple[float, int, int], ...] = ((0.80, 1, 1), (0.15, 2, 4), (0.05, 5, 10))

    def draw(self, rng: random.Random) -> int:
        r, acc = rng.random(), 0.0
        for p, lo, hi in self.buckets:
            acc += p
            if r < acc:
                return rng.randint(lo, hi)
        _, lo, hi = self.buckets[-1]
        return rng.randint(lo, hi)


def _run(sentences: Sequence[str], n: int, rng: random.Random) -> str:
    start = rng.randrange(len(sentences))
    return " ".join(sentences[(start + i) % len(sentences)] for i in range(n))


def sample_texts(
    sentences: Sequence[str], count: int, rng: random.Random, mix: LengthMix = LengthMix()
) -> list[str]:
    """`count` texts of 1..10 consecutive sentences (see LengthMix)."""
    return [_run(sentences, mix.draw(rng), rng) for _ in range(count)]


def sample_sentences(sentences: Sequence[str], count: int, rng: random.Random) -> list[str]:
    return [sentences[rng.randrange(len(sentences))] for _ in range(count)]


def skewed_int(rng: random.Random, lo: int, hi: int, median: float, sigma: float = 0.7) -> int:
    """A log-normal draw with the given median, clipped to [lo, hi]."""
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def fit_prompt(text: str, target: int, count_tokens: Callable[[str], int]) -> str:
    """The longest prefix (whole words) of `text` with at most `target` tokens (at least one word)."""
    words = text.split()
    lo, hi = 1, len(words)
    while lo < hi:  # largest k with count(words[:k]) <= target
        mid = (lo + hi + 1) // 2
        if count_tokens(" ".join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def words_as_tokens(text: str) -> int:
    """A tokenizer-free estimate (about 1.3 BPE tokens per English word), when no tokenizer is at hand."""
    return math.ceil(1.3 * len(text.split()))


@dataclass(frozen=True)
class GenerateItem:
    prompt: str
    prompt_tokens: int  # counted without special tokens
    max_tokens: int


def sample_generation(
    sentences: Sequence[str],
    count: int,
    rng: random.Random,
    count_tokens: Callable[[str], int] = words_as_tokens,
    prompt_range: tuple[int, int] = (10, 200),
    output_range: tuple[int, int] = (16, 128),
    median: float = 48,
) -> list[GenerateItem]:
    """Prompts of prompt_range tokens and output lengths of output_range tokens, both skewed short."""
    items = []
    for _ in range(count):
        target = skewed_int(rng, *prompt_range, median=median)
        text = _run(sentences, 1 + target // 8, rng)  # sentences of ~15 tokens: more than enough words
        while count_tokens(text) < target:
            text += " " + _run(sentences, 4, rng)
        prompt = fit_prompt(text, target, count_tokens)
        items.append(
            GenerateItem(prompt, count_tokens(prompt), skewed_int(rng, *output_range, median=median))
        )
    return items


def poisson_arrivals(rate: float, horizon_s: float, rng: random.Random) -> list[float]:
    """Arrival times (seconds from 0) of a Poisson process with `rate` per second, up to horizon_s."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    out, t = [], rng.expovariate(rate)
    while t < horizon_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out
