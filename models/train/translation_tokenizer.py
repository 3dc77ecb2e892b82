"""Train the shared English/Spanish subword tokenizer of our translator.

Usage::

    python -m models.train.translation_tokenizer --data data/translation \\
        --out models/weights/translator-en-es [--vocab-size 8000]

Contract of the saved ``<out>/tokenizer.json`` (a Hugging Face ``tokenizers`` file):

* one Unigram model shared by both languages, trained on both sides of ``<data>/train.tsv`` only;
* normalisation: NFKC, every run of whitespace → one space, stripped ends;
* pre-tokenisation/decoding: Metaspace (``▁``, always prepended), so decoding restores spaces exactly;
* special tokens with fixed ids: ``</s>`` = 0 (end of sentence), ``<unk>`` = 1, ``<pad>`` = 2 (padding and,
  as in Marian, the decoder start token);
* ``encode(text)`` appends ``</s>`` (TemplateProcessing), and
  ``decode(ids, skip_special_tokens=True) == normalizer.normalize_str(text)`` for text made of characters seen
  in training.  This round trip is checked on sentences of ``<data>/test.tsv`` after training.
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

logger = logging.getLogger(__name__)

EOS, UNK, PAD = "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = (EOS, UNK, PAD)  # ids 0, 1, 2, in this order
# Always in the alphabet, even if rare in the training data.
SPANISH_ALPHABET = "áéíóúüñÁÉÍÓÚÜÑ¿¡"


def read_pairs(path: Path) -> Iterator[tuple[str, str]]:
    """Yield ``(en, es)`` from an ``en<TAB>es`` TSV file."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            en, es = line.rstrip("\n").split("\t")
            yield en, es


def build_tokenizer() -> Tokenizer:
    """An untrained tokenizer with the normaliser, pre-tokeniser and decoder described in the module doc."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tokenizer


def train_tokenizer(train_tsv: Path, vocab_size: int) -> Tokenizer:
    """Train the shared Unigram tokenizer on both sides of ``train_tsv``; special tokens get ids 0, 1, 2."""

    def sentences() -> Iterator[str]:
        for en, es in read_pairs(train_tsv):
            yield en
            yield es

    tokenizer = build_tokenizer()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        unk_token=UNK,
        initial_alphabet=list(SPANISH_ALPHABET),
        max_piece_length=16,
        show_progress=False,
    )
    tokenizer.train_from_iterator(sentences(), trainer=trainer)
    ids = [tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS]
    if ids != [0, 1, 2]:
        raise AssertionError(f"special token ids are {ids}, expected [0, 1, 2]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, 0)]
    )
    return tokenizer


def check_round_trip(tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]]) -> dict[str, float]:
    """Check ``decode(encode(x)) == normalize(x)`` and that ``</s>`` ends every encoding, for both sides of
    ``pairs``; return the average number of tokens per sentence (``</s>`` excluded) for ``en`` and ``es``.

    Raises ``AssertionError`` listing the first failures if any sentence does not round-trip."""
    normalizer = tokenizer.normalizer
    assert normalizer is not None
    failures: list[str] = []
    lengths: dict[str, list[int]] = {"en": [], "es": []}
    for pair in pairs:
        for lang, text in zip(("en", "es"), pair, strict=True):
            ids = tokenizer.encode(text).ids
            decoded = tokenizer.decode(ids, skip_special_tokens=True)
            if ids[-1] != 0 or decoded != normalizer.normalize_str(text):
                failures.append(f"{text!r} -> {decoded!r}")
            lengths[lang].append(len(ids) - 1)
    if failures:
        raise AssertionError(f"{len(failures)} round-trip failures, e.g. {failures[:5]}")
    return {lang: statistics.fmean(n) for lang, n in lengths.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True, help="directory with train.tsv and test.tsv")
    parser.add_argument("--out", type=Path, required=True, help="directory to write tokenizer.json into")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--check", type=int, default=500, help="test pairs used for the round-trip check")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    tokenizer = train_tokenizer(args.data / "train.tsv", args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tokenizer.json"
    tokenizer.save(str(path))
    logger.info(
        "saved %s: vocab size %d, special ids %s",
        path,
        tokenizer.get_vocab_size(),
        {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS},
    )

    reloaded = Tokenizer.from_file(str(path))
    test = list(read_pairs(args.data / "test.tsv"))[: args.check]
    averages = check_round_trip(reloaded, test)
    logger.info(
        "round trip OK on %d test pairs; avg tokens/sentence (without </s>): en %.2f, es %.2f",
        len(test),
        averages["en"],
        averages["es"],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
