"""Per-beam processors of the next-token distribution: min_tokens, logit_bias, the frequency,
presence and repetition penalties (issue 52; docs/SERVING.md, docs/ALGORITHM.md).

Each processor depends only on a node's context (the prompt, its beam and its forest path) and
its position, so it is a function of the model: "the target with these processors" is another
model. The engine reaches models only through the calls its two sides yield (`ScoreCall`), so
`processed_steps` sits between a side and whoever answers it and rewrites every returned row
from that node's token counts. The engine then treats the processed target as THE target (and
the processed draft as the draft, which only proposes), and every law it keeps exactly (sampling,
SpS, beam sampling under both laws, DSBD, beam search and its speculative form) is the penalised
one by construction; no driver (in-process, lockstep, the serving replicas) needs to know.

A row is processed in transformers' order (`_get_logits_processor`: sequence bias, repetition
penalty, min new tokens, then user processors) on the model's log-probs `x`:

1. `x[t] += logit_bias[t]`;
2. tokens seen in the prompt or the beam: `x * p` where `x < 0`, `x / p` elsewhere
   (`RepetitionPenaltyLogitsProcessor`; on log-probs, as transformers' beam methods apply it);
3. `x[t] -= frequency_penalty * n_t + presence_penalty * (n_t > 0)`, `n_t` the number of times
   the beam has generated `t` (OpenAI and vLLM count generated tokens only);
4. before `min_tokens` generated tokens, `x[eos] = -inf` for every EOS id (vLLM's
   `MinTokensLogitsProcessor`, transformers' `MinNewTokensLengthLogitsProcessor`);
5. the paper's law and one-beam sampling renormalise the row (`log_softmax`): the processed model
   is a language model and the beams' scores are its log-likelihoods. Beam search and beam
   sampling under transformers' law do not: transformers applies processors to
   `log_softmax(logits)` and accumulates the processed values, and so do they, which is what
   makes them equal transformers' `generate` with the same processors.

Steps 1, 3 and 4 shift logits, so on the renormalised path they equal the same processors on
the logits (OpenAI's, vLLM's definition). Step 2 on log-probs always multiplies (log-probs are
<= 0); on logits (transformers' and vLLM's sampling) its effect depends on the logits' arbitrary
offset, which the engine never sees.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots, ScoreCall


@dataclass(frozen=True)
class Processors:
    """The processors of one decode (`processors_for`); `normalise`: renormalise each row."""

    vocab: int
    eos: tuple[int, ...]
    min_tokens: int
    frequency: float
    presence: float
    repetition: float
    bias: tuple[tuple[int, float], ...]
    normalise: bool

    @property
    def counts_generated(self) -> bool:
        return bool(self.frequency or self.presence)

    @property
    def counts_seen(self) -> bool:
        return self.repetition != 1.0

    def bias_row(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """[V] the logit bias as a dense row, or None without one."""
        if not self.bias:
            return None
        row = torch.zeros(self.vocab, dtype=dtype, device=device)
        ids = torch.tensor([t for t, _ in self.bias], dtype=torch.long, device=device)
        row[ids] = torch.tensor([b for _, b in self.bias], dtype=dtype, device=device)
        return row


def bias_problem(bias: Sequence[tuple[int, float]], vocab: int) -> str | None:
    """What is wrong with logit_bias for a vocabulary of `vocab` ids (None: nothing), in the
    words of an error naming the field: the key and what is allowed."""
    for token, _ in bias:
        if not 0 <= token < vocab:
            return f"token id {token} is outside the vocabulary; allowed: 0..{vocab - 1}"
    return None


def processors_for(config: SamplingConfig, vocab: int) -> Processors | None:
    """The decode's processors, or None when every one is off (the engine's path unchanged).
    Raises ValueError naming logit_bias for a token id outside the vocabulary."""
    if not config.processes_logits:
        return None
    problem = bias_problem(config.logit_bias, vocab)
    if problem is not None:
        raise ValueError(f"logit_bias: {problem}")
    return Processors(
        vocab=vocab,
        eos=tuple(sorted(set(config.eos_token_ids))),
        min_tokens=config.min_tokens,
        frequency=config.frequency_penalty,
        presence=config.presence_penalty,
        repetition=config.repetition_penalty,
        bias=config.logit_bias,
        normalise=not config.searching,
    )


@dataclass
class _Counts:
    """Token counts of one layer of nodes: generated [B, N, V] (or None), seen [B, N, V] bool
    (or None), and the number of generated tokens [B, 1] before each node's next token."""

    generated: torch.Tensor | None
    seen: torch.Tensor | None
    length: torch.Tensor

    def child(self, layer: ForestLayer) -> _Counts:
        """The counts of `layer`'s nodes: their parent's, plus their own token."""
        parent = layer.parent
        generated = seen = None
        if self.generated is not None:
            index = parent[:, :, None].expand(-1, -1, self.generated.shape[2])
            generated = self.generated.gather(1, index)
            generated.scatter_add_(2, layer.token[:, :, None], torch.ones_like(generated[:, :, :1]))
        if self.seen is not None:
            index = parent[:, :, None].expand(-1, -1, self.seen.shape[2])
            seen = self.seen.gather(1, index)
            seen.scatter_(2, layer.token[:, :, None], True)
        return _Counts(generated, seen, self.length + 1)


def _root_counts(procs: Processors, roots: Roots, prompt_len: torch.Tensor) -> _Counts:
    """The counts at the end of every root beam, from its tokens."""
    tokens = roots.tokens
    batch, rows, capacity = tokens.shape
    pos = torch.arange(capacity, device=tokens.device)
    within = pos[None, :] < roots.lengths[:, None]  # [B, L]
    prompt_len = prompt_len.to(tokens.device)
    generated = seen = None
    shape = (batch, rows, procs.vocab)
    if procs.counts_generated:
        mask = within & (pos[None, :] >= prompt_len[:, None])
        weight = mask[:, None, :].expand(batch, rows, capacity).to(torch.float64)
        generated = torch.zeros(shape, dtype=torch.float64, device=tokens.device)
        generated.scatter_add_(2, tokens, weight)
    if procs.counts_seen:
        # counted, not scattered as bools: a padding position must not clear a real one
        weight = within[:, None, :].expand(batch, rows, capacity).to(torch.float64)
        seen = torch.zeros(shape, dtype=torch.float64, device=tokens.device)
        seen = seen.scatter_add_(2, tokens, weight) > 0
    length = (roots.lengths.to(tokens.device) - prompt_len)[:, None]
    return _Counts(generated, seen, length)


def process(
    procs: Processors, logp: torch.Tensor, counts: _Counts, support: torch.Tensor | None
) -> torch.Tensor:
    """`logp` [B, N, V] (or [B, N, K] over the token ids `support`) after the processors."""
    work = logp if logp.dtype in (torch.float32, torch.float64) else logp.float()
    x = work.clone()
    columns = support
    bias = procs.bias_row(x.dtype, x.device)
    if bias is not None:
        x = x + (bias if columns is None else bias[columns])
    if counts.seen is not None:
        seen = counts.seen if columns is None else counts.seen[:, :, columns]
        penalised = torch.where(x < 0, x * procs.repetition, x / procs.repetition)
        x = torch.where(seen, penalised, x)
    if counts.generated is not None:
        generated = counts.generated if columns is None else counts.generated[:, :, columns]
        generated = generated.to(x.dtype)
        x = x - procs.frequency * generated - procs.presence * (generated > 0).to(x.dtype)
    if procs.min_tokens and procs.eos:
        early = counts.length < procs.min_tokens  # [B, 1] or [B, N]
        eos = torch.zeros(procs.vocab, dtype=torch.bool, device=x.device)
        eos[list(procs.eos)] = True
        if columns is not None:
            eos = eos[columns]
        x = x.masked_fill(early[:, :, None] & eos, float("-inf"))
    if procs.normalise:  # a row left without any token stays so (no NaN from -inf - -inf)
        empty = torch.isneginf(x).all(dim=-1, keepdim=True)
        x = torch.where(empty, x, torch.log_softmax(x, dim=-1))
    return x.to(logp.dtype)


R = TypeVar("R")


def processed_steps(
    steps: Generator[ScoreCall, ForestLogprobs, R],
    procs: Processors | None,
    prompt_len: torch.Tensor,
) -> Generator[ScoreCall, ForestLogprobs, R]:
    """A side's calls as they are, its answers processed per node: the side sees the
    processed model. `prompt_len` [B]: the sessions' prompt lengths (the state's)."""
    if procs is None:
        return (yield from steps)
    last: _Counts | None = None
    try:
        call = next(steps)
        while True:
            if call.roots is not None:
                last = _root_counts(procs, call.roots, prompt_len)
            assert last is not None, "a side's first call carries its roots"
            scored = yield call
            roots = scored.roots
            if roots is not None:
                roots = process(procs, roots, last, scored.support)
            layers = []
            for layer, logp in zip(call.layers, scored.layers, strict=True):
                last = last.child(layer)
                layers.append(process(procs, logp, last, scored.support))
            call = steps.send(ForestLogprobs(roots, layers, scored.support))
    except StopIteration as stop:
        return stop.value
