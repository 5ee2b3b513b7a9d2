"""What every decoder returns: beams with true log-likelihoods, and per-call statistics."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from dsbd_core.algorithm.draws.host_reads import on_host
from dsbd_core.algorithm.sequences.logprobs import TokenLogprobs, beam_lists
from dsbd_core.algorithm.sequences.state import Pool


@dataclass
class Beam:
    """One returned sequence.

    `log_likelihood` is the true cumulative target log-probability of the generated tokens
    (raw model distribution, before temperature/top-k/top-p), tracked separately from any
    sampling weights so that the final ranking is meaningful (ALGORITHM.md §11.7).
    """

    token_ids: list[int]
    log_likelihood: float
    finished: bool
    score: float  # log_likelihood / len(token_ids) ** length_penalty: the final ranking key
    # config.logprobs set: each token's target log-probability (the same raw distribution as
    # log_likelihood, which is their sum) and its `config.logprobs` most likely alternatives
    # (token id, log-probability), most likely first
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class DecodeStats:
    """Counters of one decode call (per session)."""

    iterations: int = 0
    target_forward_passes: int = 0
    draft_forward_passes: int = 0
    tokens_emitted: int = 0  # decoding steps = length of the longest generated sequence
    drafted_tokens: int = 0  # draft nodes proposed that had a live parent
    accepted_tokens: int = 0  # draft nodes accepted by the target
    accepted_layers: list[int] = field(default_factory=list)  # per iteration
    widths: list[list[int]] = field(default_factory=list)  # per iteration, per verified layer
    # alpha_1 = sum_x min(P_l, Q_l) = 1 - TV(P_l, Q_l) per iteration per verified layer: the
    # first draft's acceptance probability, input of dsbd.theory.predictor. Kept out of
    # as_dict (floats that differ in the last bits between equivalent scorers).
    layer_alphas: list[list[float]] = field(default_factory=list)
    # epsilon > 0 only: sum over the verification stages this request executed of
    # beta = sum_x min(eps * [P(x) > 0], (q(x) - c(x))_+), the probability that the stage's
    # decision differs from the exact rule's. Its mean over requests bounds the TV distance
    # between this decoder's output law and the exact one (docs/THEORY.md). 0 when eps = 0.
    epsilon_bias_bound: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def target_passes_per_token(self) -> float:
        return self.target_forward_passes / self.tokens_emitted if self.tokens_emitted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        n = len(self.accepted_layers)
        return sum(self.accepted_layers) / n if n else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "iterations": self.iterations,
            "target_forward_passes": self.target_forward_passes,
            "draft_forward_passes": self.draft_forward_passes,
            "tokens_emitted": self.tokens_emitted,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "target_passes_per_token": self.target_passes_per_token,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_layers": self.accepted_layers,
            "widths": self.widths,
            "epsilon_bias_bound": self.epsilon_bias_bound,
        }


@dataclass
class DecodeResult:
    """Beams best-first (by `Beam.score`), and the call's statistics."""

    beams: list[Beam]
    stats: DecodeStats

    @property
    def best(self) -> Beam:
        return self.beams[0]


def collect_results(
    batch: int,
    pool: Pool,
    steps: torch.Tensor,
    counters: dict[str, torch.Tensor],
    history: list[dict[str, torch.Tensor]],
    length_penalty: float,
    keep: int | None = None,
) -> list[DecodeResult]:
    """Every session's pooled beams ranked best-first (the best `keep` of them when given), and
    its statistics from the counters and the per-iteration records (tensors become Python
    numbers once, here, at the end, after one copy to the host). Python's cyclic collector is
    paused meanwhile: the beams and statistics made here hold no cycles, and a batch call of
    1e5 sessions makes millions of objects, whose allocation set off full collections over the
    whole heap that took about 60 % of this function's time (`_collector_paused`;
    benchmarks/results/suite_time_epyc.json, "collect_results_collector_paused")."""
    parts: list[Any] = [
        pool.session,
        pool.tokens,
        pool.length,
        pool.score,
        pool.finished,
        [(p.chosen, p.top_ids, p.top_logp) for p in pool.logprobs],
        pool.kept,
    ]
    parts, steps, counters, history = on_host((parts, steps, counters, history))
    with _collector_paused():
        return _results(batch, parts, steps, counters, history, length_penalty, keep)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was, after): reference
    counting still frees everything that holds no cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _results(
    batch: int,
    parts: list[Any],
    steps: torch.Tensor,
    counters: dict[str, torch.Tensor],
    history: list[dict[str, torch.Tensor]],
    length_penalty: float,
    keep: int | None,
) -> list[DecodeResult]:
    """`collect_results` on the host's copies (`parts`: the pool's tensors, in its order)."""
    pool = Pool(
        parts[0],
        parts[1],
        parts[2],
        parts[3],
        parts[4],
        logprobs=[TokenLogprobs(*p) for p in parts[5]],
        kept=parts[6],
    )
    beams: list[list[Beam]] = [[] for _ in range(batch)]
    if pool.session:
        kept = torch.cat(pool.kept)  # rows a device pooled under a mask: only these are beams
        session = torch.cat(pool.session)[kept].tolist()
        tokens = torch.cat(pool.tokens)[kept].tolist()
        lengths = torch.cat(pool.length)[kept].tolist()
        scores = torch.cat(pool.score)[kept].tolist()
        finished = torch.cat(pool.finished)[kept].tolist()
        logprobs = _cat(pool.logprobs) if pool.logprobs else None
        for i, (b, tok, n, s, f) in enumerate(
            zip(session, tokens, lengths, scores, finished, strict=True)
        ):
            beam = Beam(tok[:n], s, f, s / max(n, 1) ** length_penalty)
            if logprobs is not None:
                beam.token_logprobs, beam.top_logprobs = beam_lists(logprobs, i, n)
            beams[b].append(beam)
    stats = [DecodeStats() for _ in range(batch)]
    columns = {name: counters[name].tolist() for name in counters}
    emitted = steps.tolist()
    for b, st in enumerate(stats):
        st.target_forward_passes, st.draft_forward_passes = (
            columns["target"][b],
            columns["draft"][b],
        )
        st.drafted_tokens, st.accepted_tokens = columns["drafted"][b], columns["accepted"][b]
        st.tokens_emitted = emitted[b]
        st.epsilon_bias_bound = columns["epsilon_bias"][b]
    for record in history:
        live = record["live"].nonzero(as_tuple=True)[0].tolist()
        layers = record["accepted_layers"].tolist()
        widths = record["widths"].tolist()
        alphas = record["alphas"].tolist()
        for b in live:
            st = stats[b]
            st.iterations += 1
            st.accepted_layers.append(layers[b])
            st.widths.append([w for w in widths[b] if w >= 0])
            st.layer_alphas.append([a for a in alphas[b] if a >= 0])
    results = []
    for b in range(batch):
        ranked = sorted(beams[b], key=lambda beam: (-beam.score, beam.token_ids))
        results.append(DecodeResult(beams=ranked[:keep], stats=stats[b]))
    return results


def _cat(parts: list[TokenLogprobs]) -> TokenLogprobs:
    return TokenLogprobs(
        torch.cat([p.chosen for p in parts]),
        torch.cat([p.top_ids for p in parts]),
        torch.cat([p.top_logp for p in parts]),
    )
