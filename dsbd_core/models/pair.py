"""A target and its draft, loaded the way every entry point runs them.

`dsbd generate`, `dsbd bench`, `dsbd batch` and the serving replicas all load models through
here, so that they share one meaning of `dtype: auto` (`dtypes.py`) and of the draft options
(`DraftOptions`: int8 layers and a restricted head, `draft_variants.py`); what was chosen is
described in one line that every entry point prints and records with its results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.models.draft_variants import quantize_int8, restrict_head
from dsbd_core.models.dtypes import dtype_name, resolve_dtype
from dsbd_core.models.loading import LoadedModel, check_same_vocabulary, load_causal_lm
from dsbd_core.models.token_frequencies import frequent_tokens
from dsbd_core.models.tokens import encode_prompt, stop_token_ids


class DraftOptions(BaseModel):
    """How the draft is made cheap (config files, CLI flags). Exact whatever is chosen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantize: Literal["none", "int8", "auto"] = Field(
        "auto",
        description="int8 dynamic quantisation of the draft's linear layers (CPU only). auto: "
        "on a CPU, whichever of int8 and the model dtype runs a draft step faster here.",
    )
    head_tokens: int = Field(
        0, ge=0,
        description="Restrict the draft's output layer to this many most frequent tokens "
        "(FR-Spec; the draft never proposes another token). 0: the full vocabulary.",
    )  # fmt: skip


@dataclass
class LoadedPair:
    """The loaded target (and draft), their dtype and what was done to the draft."""

    target: LoadedModel
    draft: LoadedModel | None
    dtype: torch.dtype
    dtype_reason: str
    draft_variant: str  # e.g. "int8 linear layers, head 32770 of 151936 tokens"

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return stop_token_ids(self.target)

    def describe(self) -> str:
        draft = f"; draft {self.draft.name}: {self.draft_variant}" if self.draft else ""
        return f"target {self.target.name}: {self.dtype_reason}{draft}"

    def encode(self, text: str, *, chat: bool | None = None) -> list[int]:
        return encode_prompt(self.target, text, chat=chat)

    def sampling_config(self, max_new_tokens: int, seed: int | None = 0) -> SamplingConfig:
        """A base config with this target's stop tokens."""
        return SamplingConfig(max_new_tokens=max_new_tokens, seed=seed,
                              eos_token_ids=self.stop_ids)  # fmt: skip


def load_pair(
    target: str,
    draft: str | None,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    draft_options: DraftOptions | None = None,
) -> LoadedPair:
    """Load `target` (and `draft`) in the dtype `dtype` means on `device`; make the draft cheap
    as `draft_options` say; check that they share a vocabulary."""
    torch_dtype, reason = resolve_dtype(dtype, device)
    loaded_target = load_causal_lm(target, dtype=torch_dtype)
    loaded_target.model.to(device)
    if draft is None:
        return LoadedPair(loaded_target, None, torch_dtype, reason, "")
    loaded_draft = load_causal_lm(draft, dtype=torch_dtype)
    check_same_vocabulary(loaded_target, loaded_draft)
    loaded_draft.model.to(device)
    variant = prepare_draft(loaded_draft, draft_options or DraftOptions(), stop_token_ids(
        loaded_target))  # fmt: skip
    return LoadedPair(loaded_target, loaded_draft, torch_dtype, reason, variant)


def prepare_draft(draft: LoadedModel, options: DraftOptions, stop_ids: tuple[int, ...] = ()) -> str:
    """Apply the draft options to `draft.model` in place; returns what was done, in words."""
    done = []
    vocab = draft.vocab_size
    if options.head_tokens:
        keep = frequent_tokens(draft.tokenizer, vocab, options.head_tokens, stop_ids)
        restrict_head(draft.model, keep)
        done.append(f"head {keep.numel()} of {vocab} tokens")
    quantize = options.quantize
    if quantize == "auto":
        quantize = _faster_on_this_cpu(draft) if draft.model.device.type == "cpu" else "none"
    if quantize == "int8":
        quantize_int8(draft.model)
        done.append("int8 linear layers")
    else:
        done.append(f"{dtype_name(draft.model.dtype)} linear layers")
    return ", ".join(reversed(done)) if done else "as loaded"


def _faster_on_this_cpu(draft: LoadedModel) -> Literal["none", "int8"]:
    """Time a cached 4-token draft step in its dtype and int8-quantised (a copy); the faster.

    Measured once per process and draft (a second or two): whether int8 wins depends on the
    CPU (int8 dot-product units) and on the model's width.
    """
    import copy

    quantized = quantize_int8(copy.deepcopy(draft.model))
    return "int8" if _step_seconds(quantized) < _step_seconds(draft.model) else "none"


def _step_seconds(model: torch.nn.Module, context: int = 64, tokens: int = 4) -> float:
    """Median time of a forward over `tokens` new tokens after a `context`-token prefix."""
    ids = torch.arange(1, context + tokens + 1).remainder(1000)[None, :].to(model.device)
    times = []
    with torch.inference_mode():
        prefix = model(input_ids=ids[:, :context], use_cache=True).past_key_values
        for _ in range(5):
            cache = copy_cache(prefix)
            start = time.perf_counter()
            model(input_ids=ids[:, context:], past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def copy_cache(cache):  # noqa: ANN001, ANN201 - a transformers Cache
    """A deep copy of a KV cache (a forward appends to the cache it is given)."""
    import copy

    return copy.deepcopy(cache)
