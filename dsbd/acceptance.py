"""How good is a draft for a target? Acceptance `Σ_x min(p(x), q(x))` and greedy agreement.

At one position with target next-token distribution `p` and draft distribution `q` (both at the
sampling temperature), `Σ_x min(p(x), q(x)) = 1 - TV(p, q)` is the probability that one
speculative-sampling draw from the draft is accepted (Leviathan et al. 2023), and
`argmax p == argmax q` is whether greedy decoding would accept the draft's token. Both are
averaged over the positions of continuations that the TARGET sampled (the text a decoder at that
temperature actually meets), teacher-forced through both models.

Pure functions on models and token ids, so the CLI (`dsbd eval-acceptance`), the distillation
loop's held-out figure and `benchmarks/investigations/draft_depth/draft_depth.py` all measure
the same thing. They run on whatever device the model is on (`model_device`); the sampling RNG
always lives on the CPU, so a seed draws the same tokens on a GPU as on the CPU wherever the
probabilities agree.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ScoredSequence:
    """Token ids whose positions `start..len-1` are scored: each is predicted from its prefix."""

    token_ids: tuple[int, ...]
    start: int
    kind: str = "all"

    @property
    def positions(self) -> int:
        return len(self.token_ids) - self.start


@dataclass
class KindStats:
    """Acceptance and greedy agreement over the scored positions of one kind."""

    positions: int = 0
    acceptance_sum: float = 0.0
    greedy_sum: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.acceptance_sum / self.positions if self.positions else float("nan")

    @property
    def greedy_agreement(self) -> float:
        return self.greedy_sum / self.positions if self.positions else float("nan")

    def add(self, overlap: torch.Tensor, agree: torch.Tensor) -> None:
        self.positions += overlap.numel()
        self.acceptance_sum += overlap.double().sum().item()
        self.greedy_sum += agree.double().sum().item()

    def as_dict(self) -> dict[str, float | int]:
        return {
            "positions": self.positions,
            "acceptance": self.acceptance,
            "greedy_agreement": self.greedy_agreement,
        }


@dataclass
class AcceptanceReport:
    """Per-kind and overall (every scored position weighs the same) figures."""

    kinds: dict[str, KindStats] = field(default_factory=dict)
    temperature: float = 1.0

    @property
    def overall(self) -> KindStats:
        total = KindStats()
        for stats in self.kinds.values():
            total.positions += stats.positions
            total.acceptance_sum += stats.acceptance_sum
            total.greedy_sum += stats.greedy_sum
        return total

    def add(self, kind: str, overlap: torch.Tensor, agree: torch.Tensor) -> None:
        self.kinds.setdefault(kind, KindStats()).add(overlap, agree)

    def as_dict(self) -> dict:
        return {
            "temperature": self.temperature,
            "overall": self.overall.as_dict(),
            "kinds": {kind: stats.as_dict() for kind, stats in self.kinds.items()},
        }


def agreement(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of two `[..., V]` probability tensors: `Σ_x min(p, q)` and `argmax p == argmax q`."""
    if p.shape != q.shape:
        raise ValueError(f"distributions differ in shape: {tuple(p.shape)} vs {tuple(q.shape)}")
    overlap = torch.minimum(p, q).sum(-1)
    agree = p.argmax(-1) == q.argmax(-1)
    return overlap, agree


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of `model`'s first parameter or buffer (the CPU for a model without any):
    inputs built here go there, so callers only move the model."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


@torch.inference_mode()
def next_token_probs(
    model: torch.nn.Module, sequence: ScoredSequence, temperature: float = 1.0
) -> torch.Tensor:
    """`[positions, V]` float32 next-token distributions at the scored positions (teacher
    forced)."""
    if not 1 <= sequence.start <= len(sequence.token_ids):
        raise ValueError(f"start={sequence.start} outside 1..{len(sequence.token_ids)}")
    ids = torch.tensor([sequence.token_ids], device=model_device(model))
    logits = model(ids).logits[0, sequence.start - 1 : -1].float()
    return torch.softmax(logits / temperature, dim=-1)


def measure_acceptance(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    sequences: Sequence[ScoredSequence],
    *,
    temperature: float = 1.0,
    target_probs: Sequence[torch.Tensor] | None = None,
) -> AcceptanceReport:
    """Acceptance and greedy agreement of `draft` for `target` on `sequences`, per kind.

    `target_probs` (one `[positions, V]` tensor per sequence, at `temperature`) skips the
    target's forward passes when they are already known (a cached held-out set). The two
    distributions are compared on the draft's device.
    """
    report = AcceptanceReport(temperature=temperature)
    for index, sequence in enumerate(sequences):
        if sequence.positions == 0:
            continue
        p = (
            target_probs[index].float()
            if target_probs is not None
            else next_token_probs(target, sequence, temperature)
        )
        q = next_token_probs(draft, sequence, temperature)
        report.add(sequence.kind, *agreement(p.to(q.device), q))
    return report


@torch.inference_mode()
def sample_continuations(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
    batch_size: int = 8,
    kinds: Sequence[str] | None = None,
    return_logits: bool = False,
) -> tuple[list[ScoredSequence], list[torch.Tensor]]:
    """Continuations of `prompts` sampled from `model` (pure temperature sampling, no top-k/p).

    Prompts go through in left-padded batches of `batch_size`; a continuation ends after its
    first stop token (kept) or after `new_tokens` tokens. Returns one `ScoredSequence` per prompt
    (prompt + continuation, scored from the continuation's start) and, when `return_logits`,
    the model's raw `[continuation_len, V]` logits at each sampled position (what a teacher
    forced pass would give, up to batching round-off). Deterministic for a given seed and
    `batch_size`, but NOT independent of `batch_size`: one generator feeds every batch in turn
    and each step draws one token per row of the batch, so regrouping the prompts hands each
    (prompt, position) other random numbers.
    """
    generator = torch.Generator().manual_seed(seed)
    device = model_device(model)
    stops = set(stop_ids)
    sequences: list[ScoredSequence] = []
    all_logits: list[torch.Tensor] = []
    for first in range(0, len(prompts), batch_size):
        batch = [list(p) for p in prompts[first : first + batch_size]]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        generated, step_logits = _sample_batch(
            model, ids.to(device), mask.to(device), new_tokens, temperature, generator
        )
        for row, prompt in enumerate(batch):
            tokens = generated[row].tolist()
            for end, token in enumerate(tokens):
                if token in stops:
                    tokens = tokens[: end + 1]
                    break
            kind = kinds[first + row] if kinds is not None else "all"
            sequences.append(ScoredSequence(tuple(prompt + tokens), len(prompt), kind))
            if return_logits:
                all_logits.append(step_logits[row, : len(tokens)].clone())
    return sequences, all_logits


def _sample_batch(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV-cached sampling loop: `[B, new_tokens]` tokens and the `[B, new_tokens, V]` logits.

    Rows keep sampling after their stop token (the caller truncates), which keeps the loop
    simple and the draws of every row independent of when the others stop. `generator` is a CPU
    generator whatever the model's device: the draw happens on the CPU (a no-op move there), so
    the random stream does not depend on the device.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    logits = out.logits[:, -1].float()
    tokens, kept = [], []
    next_position = positions[:, -1:] + 1
    for step in range(new_tokens):
        kept.append(logits)
        probs = torch.softmax(logits / temperature, dim=-1)
        token = torch.multinomial(probs.cpu(), 1, generator=generator).to(probs.device)
        tokens.append(token)
        if step + 1 == new_tokens:
            break
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(token, attention_mask=mask, position_ids=next_position, past_key_values=cache)
        logits = out.logits[:, -1].float()
        next_position = next_position + 1
    return torch.cat(tokens, dim=1), torch.stack(kept, dim=1)


def encode_prompt_for(target, prompt) -> list[int]:
    """Token ids of a `prompts.Prompt` for a `LoadedModel`; a chat prompt on a model without a
    chat template is encoded as plain text (a base model simply continues it)."""
    from dsbd_core.models import encode_prompt, has_chat_template

    return encode_prompt(target, prompt.text, chat=prompt.chat and has_chat_template(target))


def sample_prompt_continuations(
    target,
    prompts,
    new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    *,
    batch_size: int = 8,
) -> list[ScoredSequence]:
    """Target-sampled continuations of `prompts.Prompt`s, scored from the continuation on.

    `target` is a `LoadedModel`; stop tokens and padding come from it. With the same settings
    this gives the same sequences every time: `dsbd eval-acceptance` and the held-out set of
    `dsbd distill` (seed 0, 64 tokens, batch 8) are the same text.
    """
    from dsbd_core.models import stop_token_ids

    pad = target.tokenizer.pad_token_id
    sequences, _ = sample_continuations(
        target.model,
        [encode_prompt_for(target, p) for p in prompts],
        new_tokens=new_tokens,
        temperature=temperature,
        seed=seed,
        stop_ids=stop_token_ids(target),
        pad_id=pad if pad is not None else 0,
        batch_size=batch_size,
        kinds=[p.kind for p in prompts],
    )
    return sequences
