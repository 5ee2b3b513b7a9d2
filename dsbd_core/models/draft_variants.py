"""Cheaper drafts, exact by construction: int8 linear layers and a head over frequent tokens.

Verification uses the q the draft actually computed (the forest carries every layer's draft
table), so any change to how the draft computes q keeps DSBD exact; it only moves the
acceptance rate, which `dsbd eval-acceptance` measures. Two such changes pay on a CPU:

* **int8 dynamic quantisation** of the draft's `nn.Linear` layers (`row_int8`: int8 weights
  per output channel, activations quantised per row, so a row's output depends on that row
  alone): the weights are read as int8, a quarter of float32's bytes; a draft step is
  memory-bound, so it costs about half of a bfloat16 step (Qwen2.5-Coder-0.5B, 1 thread: 58 ms
  against 135 ms, docs/ARCHITECTURE.md "Measured facts about CPUs", before bfloat16 weights
  were prepacked: `auto` measures).
* **a head restricted to the K most frequent tokens** (FR-Spec, Zhao et al., ACL 2025): the
  output embedding of a small model is a large share of its weights (SmolLM2-135M: a fifth;
  Qwen2.5-0.5B: 136M of 494M parameters), and most of its rows are tokens a draft almost never
  needs. The restricted head computes logits for K tokens only and gives every other token
  -inf, i.e. q = 0 outside: the draft never proposes such a token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal, cast

import torch
from torch import nn

from dsbd_core.models.row_int8 import quantize_linears

if TYPE_CHECKING:  # imported for annotations only: it costs ~3 s of CPU to import
    from transformers import PreTrainedModel

Quantize = Literal["none", "int8", "auto"]
QUANTIZE_CHOICES: tuple[str, ...] = ("none", "int8", "auto")


class RestrictedHead(nn.Module):
    """An output layer that scores only `keep` (sorted token ids); -inf for every other token.

    Its output keeps the full vocabulary width (`out_features`), so everything downstream
    (log-softmax, the scorer, the forest tables) sees an ordinary distribution with zeros.
    """

    keep: torch.Tensor  # a registered buffer

    def __init__(self, head: nn.Module, keep: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        weight = cast(torch.Tensor, head.weight).detach()  # an output layer's weight
        bias = getattr(head, "bias", None)
        self.proj = nn.Linear(weight.shape[1], keep.numel(), bias=bias is not None)
        self.proj.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(weight[keep])
            if bias is not None:
                self.proj.bias.copy_(bias.detach()[keep])
        self.register_buffer("keep", keep.to(weight.device), persistent=False)
        self.out_features = vocab_size
        self.in_features = weight.shape[1]
        # The scorer switches this on around its own forwards (`compact_logits`): then the
        # logits are the K kept tokens' only; anyone else (transformers' generate) gets V.
        self.compact = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.proj(hidden)
        if self.compact:
            return small
        out = small.new_full((*small.shape[:-1], self.out_features), float("-inf"))
        return out.index_copy_(-1, self.keep, small)


def restrict_head(model: PreTrainedModel, keep: torch.Tensor) -> PreTrainedModel:
    """Replace the model's output layer by a `RestrictedHead` over `keep` (in place)."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError("the draft has no output embedding to restrict")
    vocab = int(head.weight.shape[0])
    keep = torch.unique(keep.to(torch.long))  # sorted, no repeats
    if keep.numel() == 0 or int(keep.max()) >= vocab or int(keep.min()) < 0:
        raise ValueError(f"head tokens must be ids in [0, {vocab}), got {keep.numel()} ids")
    model.config.tie_word_embeddings = False  # the new head is its own weight
    model.set_output_embeddings(RestrictedHead(head, keep, vocab))
    return model


class _Fused(nn.Module):
    """Several linear layers that read the same input, as one: their weights stacked."""

    def __init__(self, parts: list[nn.Linear]) -> None:
        super().__init__()
        weight = torch.cat([part.weight.detach() for part in parts])
        has_bias = any(part.bias is not None for part in parts)
        self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
        self.linear.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if has_bias:
                biases = [
                    part.bias.detach()
                    if part.bias is not None
                    else weight.new_zeros(part.out_features)
                    for part in parts
                ]
                self.linear.bias.copy_(torch.cat(biases))
        bounds = torch.tensor([0] + [part.out_features for part in parts]).cumsum(0).tolist()
        self.bounds = list(zip(bounds[:-1], bounds[1:], strict=True))
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self._input is not x:  # the first of the parts to read this input computes them all
            self._input, self._output = x, self.linear(x)
        assert self._output is not None
        begin, end = self.bounds[index]
        out = self._output[..., begin:end]
        if index == len(self.bounds) - 1:
            self._input = self._output = None  # the last part read: hold no activations
        return out


class _Part(nn.Module):
    """One of a `_Fused` layer's outputs, where the model calls the original layer."""

    def __init__(self, fused: _Fused, index: int, out_features: int) -> None:
        super().__init__()
        self.fused, self.index, self.out_features = fused, index, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)


def fuse_projections(model: PreTrainedModel) -> int:
    """Stack each attention's q, k and v projections, and each MLP's gate and up projections,
    into one linear layer (in place); returns how many groups were fused.

    A small draft's step is a few hundred linear calls on a handful of rows, and each call has
    a fixed cost (an int8 layer quantises its input first): the 0.5B Qwen draft's 168 calls per
    forward become 96. The model code still calls q_proj, k_proj, v_proj (gate_proj, up_proj)
    one after the other on the same input; the first call computes the stacked product, the
    others take their slice of it. Same arithmetic, so the draft's q changes only by rounding.
    """
    groups = 0
    for module in model.modules():
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parts = [getattr(module, name, None) for name in names]
            if all(type(part) is nn.Linear for part in parts):
                fused = _Fused(parts)  # type: ignore[arg-type]  # all checked nn.Linear above
                for index, (name, part) in enumerate(zip(names, parts, strict=True)):
                    setattr(module, name, _Part(fused, index, part.out_features))  # type: ignore[union-attr]  # all checked nn.Linear above
                module.add_module("_fused_" + names[0], fused)
                groups += 1
    return groups


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """int8 dynamic quantisation of every `nn.Linear` (weights int8 per output channel,
    activations quantised per row of each call; the linear layers fused first where they share
    an input).

    oneDNN's dynamic int8 kernel takes float32 inputs, so the model is first made float32 (its
    non-linear parts then run in float32 as well).
    """
    if model.device.type != "cpu":
        raise ValueError(f"int8 dynamic quantisation runs on the CPU only, not {model.device}")
    model = model.to(torch.float32)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types self
    fuse_projections(model)
    use_int8_engine()
    # Per output channel: one scale per weight row. Per tensor, Qwen2.5-0.5B's acceptance
    # against its 1.5B target fell from 0.874 (float) to 0.800; per channel it is 0.831
    # (Σ min(p, q) on HumanEval continuations the target sampled), activations then scaled per
    # call; they are scaled per row now (row_int8: batch-invariant, and no row is crushed by a
    # larger batch mate).
    quantize_linears(model)
    return model


def use_int8_engine() -> str:
    """Pick the process's quantized engine: oneDNN where the CPU has AMX-INT8 tiles.

    With AMX a dynamically quantised linear layer costs about the same for 1 and 32 rows
    (Qwen2.5-0.5B's 896 x 4864 MLP: 255 us and 335 us), where the default x86 engine grows
    with the rows (216 us and 539 us): a draft call feeds a forest layer or the roots' new
    tokens, several rows. The engine is process-wide; it must be set before quantising (the
    weights are packed for it) and stay set while the model runs.
    """
    engines = torch.backends.quantized.supported_engines
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    wanted = "onednn" if amx and "onednn" in engines else "x86" if "x86" in engines else None
    if wanted is not None and torch.backends.quantized.engine != wanted:
        torch.backends.quantized.engine = wanted
    return torch.backends.quantized.engine


@contextlib.contextmanager
def compact_logits(model: PreTrainedModel) -> Iterator[torch.Tensor | None]:
    """Within the block the model's logits are over its restricted head's tokens only (yields
    their ids); None and nothing changes for a model with a full head."""
    head = model.get_output_embeddings()
    if not isinstance(head, RestrictedHead):
        yield None
        return
    head.compact = True
    try:
        yield head.keep
    finally:
        head.compact = False


def head_support(model: PreTrainedModel) -> torch.Tensor | None:
    """The token ids a restricted head scores, or None for a full head."""
    head = model.get_output_embeddings()
    return head.keep if isinstance(head, RestrictedHead) else None


def output_size(model: PreTrainedModel) -> int:
    """The width of the model's logits: its output layer's `out_features`, else its weight rows,
    else the config's vocabulary (a restricted or quantised head has no plain weight)."""
    head = model.get_output_embeddings()
    size = getattr(head, "out_features", None)
    if isinstance(size, int):
        return size
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)
