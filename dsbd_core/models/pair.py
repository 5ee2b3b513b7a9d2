"""A target and its draft, loaded the way every entry point runs them.

`dsbd generate`, `dsbd bench`, `dsbd batch` and the serving replicas all load models through
here, so that they share one meaning of `dtype: auto` (`dtypes.py`), of the draft options
(`DraftOptions`: int8 layers and a restricted head, `draft_variants.py`) and of the cost model's
calibration (`calibrate.py`); what was chosen is described in one line that every entry point
prints and records with its results.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.policy.cost_model import Calibration
from dsbd_core.algorithm.scorers.ngram_bounds import LOOKUP_DRAFT, describe_lookup
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from dsbd_core.models.calibrate import calibrate, forward_costs, machine, pass_rate_inputs
from dsbd_core.models.decode_path import make_scorer, resolve_decode_path
from dsbd_core.models.draft_variants import head_support, quantize_int8, restrict_head
from dsbd_core.models.dtypes import dtype_name, resolve_dtype
from dsbd_core.models.errors import ModelSourceError
from dsbd_core.models.loading import LoadedModel, check_same_vocabulary, load_causal_lm
from dsbd_core.models.options import DraftOptions
from dsbd_core.models.presets import cache_root
from dsbd_core.models.row_chunks import chunk_linear_rows
from dsbd_core.models.token_frequencies import frequent_tokens
from dsbd_core.models.tokens import encode_prompt, stop_token_ids
from dsbd_core.models.transformer_scorer import TransformerScorer


@dataclass
class LoadedPair:
    """The loaded target (and draft), their dtype and what was done to the draft."""

    target: LoadedModel
    draft: LoadedModel | None
    dtype: torch.dtype
    dtype_reason: str
    draft_variant: str  # e.g. "int8 linear layers, head 32770 of 151936 tokens"
    device: str = "cpu"
    decode_path: str = "dynamic"  # resolved: dynamic or static (`decode_path.py`)
    # the prompt-lookup draft (`--draft ngram`): its n-gram bound; `draft` is then None
    lookup: int | None = None

    @property
    def has_draft(self) -> bool:
        """A draft takes part: a model, or the prompt lookup."""
        return self.draft is not None or self.lookup is not None

    @property
    def draft_name(self) -> str | None:
        if self.lookup is not None:
            return LOOKUP_DRAFT
        return self.draft.name if self.draft is not None else None

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return stop_token_ids(self.target)

    def describe(self) -> str:
        draft = f"; draft {self.draft_name}: {self.draft_variant}" if self.has_draft else ""
        return (
            f"target {self.target.name}: {self.dtype_reason}{draft}; {self.decode_path} decode path"
        )

    def encode(self, text: str, *, chat: bool | None = None) -> list[int]:
        return encode_prompt(self.target, text, chat=chat)

    def sampling_config(self, max_new_tokens: int, seed: int | None = 0) -> SamplingConfig:
        """A base config with this target's stop tokens."""
        return SamplingConfig(max_new_tokens=max_new_tokens, seed=seed, eos_token_ids=self.stop_ids)

    def identity(self) -> dict[str, object]:
        """What the pair's costs depend on besides the machine (the calibration's cache key)."""
        return {
            "target": model_identity(self.target),
            "draft": model_identity(self.draft) if self.draft else self._lookup_identity(),
            "draft_variant": self.draft_variant,
            "dtype": self.dtype_name,
            "device": self.device,
            "decode_path": self.decode_path,
            "description": self.describe(),
        }

    def _lookup_identity(self) -> str | None:
        return f"{LOOKUP_DRAFT}-{self.lookup}" if self.lookup is not None else None

    def calibration(
        self, *, force: bool = False, say: Callable[[str], None] = print
    ) -> Calibration:
        """The cost model's calibration for this pair here (measured once, then cached)."""
        if self.lookup is not None:
            from dsbd_core.models.lookup_calibration import calibrate_lookup

            return calibrate_lookup(self, force=force, say=say)
        draft = self.draft.model if self.draft is not None else None
        support = head_support(draft) if draft is not None else None
        prompts = pass_rate_inputs(self.target)["prompts"]
        return calibrate(
            self.target.model,
            draft,
            self.identity(),
            self.target.vocab_size,
            draft_support=support,
            force=force,
            say=say,
            path=self.decode_path,
            prompts=prompts,
            stop_ids=self.stop_ids,
        )

    def scorers(self) -> tuple[TransformerScorer, TransformerScorer | NgramDraft | None]:
        """New scorers of the target and the draft on the pair's decode path."""
        draft: TransformerScorer | NgramDraft | None = None
        if self.lookup is not None:
            draft = NgramDraft(self.target.vocab_size, self.lookup)
        elif self.draft is not None:
            draft = make_scorer(self.draft.model, self.decode_path)
        return make_scorer(self.target.model, self.decode_path), draft


def model_identity(loaded: LoadedModel) -> str:
    """A short hash of a model's source and configuration (stands for its weights)."""
    config = loaded.model.config.to_json_string(use_diff=False)
    text = f"{loaded.name}|{loaded.path}|{config}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_pair(
    target: str,
    draft: str | None,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    draft_options: DraftOptions | None = None,
    decode_path: str = "auto",
) -> LoadedPair:
    """Load `target` (and `draft`) in the dtype `dtype` means on `device`; make the draft cheap
    as `draft_options` say; check that they share a vocabulary. `decode_path` (auto, dynamic,
    static) is checked first. `draft` 'ngram' is the prompt-lookup draft (no weights)."""
    path = resolve_decode_path(decode_path, device)
    torch_dtype, reason = resolve_dtype(dtype, device)
    options = draft_options or DraftOptions()
    loaded_target = load_causal_lm(target, dtype=torch_dtype)
    loaded_target.model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types self
    if draft is None:
        return LoadedPair(loaded_target, None, torch_dtype, reason, "", device, path)
    if draft == LOOKUP_DRAFT:
        lookup = describe_lookup(options.ngram_max)
        return LoadedPair(
            loaded_target, None, torch_dtype, reason, lookup, device, path, options.ngram_max
        )
    try:
        loaded_draft = load_causal_lm(draft, dtype=torch_dtype)
    except ModelSourceError as error:
        raise ModelSourceError(
            f"draft: {error}; or {LOOKUP_DRAFT!r} (the prompt-lookup draft)"
        ) from None
    check_same_vocabulary(loaded_target, loaded_draft)
    loaded_draft.model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types self
    variant = prepare_draft(loaded_draft, options, stop_token_ids(loaded_target))
    return LoadedPair(loaded_target, loaded_draft, torch_dtype, reason, variant, device, path)


def prepare_draft(draft: LoadedModel, options: DraftOptions, stop_ids: tuple[int, ...] = ()) -> str:
    """Apply the draft options to `draft.model` in place; returns what was done, in words."""
    done = []
    vocab = draft.vocab_size
    head = options.head_for(vocab)
    if head and head < vocab:
        keep = frequent_tokens(draft.tokenizer, vocab, head, stop_ids)
        restrict_head(draft.model, keep)
        done.append(f"head {keep.numel()} of {vocab} tokens")
    quantize = options.quantize
    if quantize == "auto":
        # float64 is the dtype of exactness tests: the draft stays as loaded there
        usable = draft.model.device.type == "cpu" and draft.model.dtype != torch.float64
        quantize = _faster_on_this_cpu(draft) if usable else "none"
    if quantize == "int8":
        quantize_int8(draft.model)
        done.append(
            "int8 linear layers (per-channel weights, per-row activations, q/k/v and gate/up fused)"
        )
    else:
        done.append(f"{dtype_name(draft.model.dtype)} linear layers")
    return ", ".join(reversed(done))


def _faster_on_this_cpu(draft: LoadedModel) -> Literal["none", "int8"]:
    """Whether a 4-token draft step is faster int8-quantised than as loaded, here.

    Measured once per machine and draft, and cached next to the calibrations: the draft's
    variant changes its q and so the seeded tokens, which must not depend on timing noise.
    """
    key = {
        "draft": model_identity(draft),
        "dtype": dtype_name(draft.model.dtype),
        "int8": "per-row activations",
        "as_loaded": "prepacked",
        **machine(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    folder = os.environ.get("DSBD_CALIBRATION_DIR") or str(cache_root() / "calibration")
    path = Path(folder) / f"int8-{digest[:20]}.json"
    if path.is_file():
        return json.loads(path.read_text())["choice"]
    quantized = quantize_int8(copy.deepcopy(draft.model))
    as_served = copy.deepcopy(draft.model)
    chunk_linear_rows(as_served)  # as the scorer runs it (prepacked bfloat16 weights)
    as_loaded = forward_costs(as_served, points=(4,)).seconds[0]
    int8 = forward_costs(quantized, points=(4,)).seconds[0]
    choice: Literal["none", "int8"] = "int8" if int8 < as_loaded else "none"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps({"choice": choice, "int8_s": int8, "as_loaded_s": as_loaded}))
    partial.replace(path)
    return choice
