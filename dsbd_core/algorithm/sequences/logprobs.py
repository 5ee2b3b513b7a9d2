"""Per-token log-probabilities of the beams, tracked while decoding (no extra forward).

What OpenAI's `logprobs` report, for every generated token of every returned beam: the target's
log-probability of the token and, asked for N > 0, the N most likely tokens at that position.
The distribution is the target's raw one (log-softmax of its logits, before temperature, top-k
and top-p), the one `Beam.log_likelihood` sums: a beam's token log-probs add up to it.

Where they come from: the target's one forward per iteration (`verify_forest`, `search.walk`)
returns the log-probs at every root beam and forest node. A token's log-prob is an entry of its
parent's row, its alternatives the row's top N (one `topk` per walked layer, only when N > 0).
Nothing here runs unless `SamplingConfig.logprobs` is set: the default path adds nothing.

Who holds what: the router-side `DecodeState.logprobs` keeps the rows of the current beams
([B, W, T], T = max_new_tokens + 1 generated positions). The verifier never receives them: it
sends back, per new or finished beam, only the positions this iteration added and the input row
the beam descends from (`Segment`), and `Engine.advance` splices them onto that row. So the
per-iteration message to the verifier does not grow with the log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsbd_core.algorithm.scorer import ForestLayer


@dataclass
class TokenLogprobs:
    """Log-probs of tokens along the last dimension `T` of `chosen`: the token's own, and the
    top-N alternatives (ids and log-probs, most likely first; N may be 0)."""

    chosen: torch.Tensor  # [..., T] float64
    top_ids: torch.Tensor  # [..., T, N] long
    top_logp: torch.Tensor  # [..., T, N] float64

    @classmethod
    def zeros(
        cls, leading: tuple[int, ...], positions: int, top: int, device: torch.device | str = "cpu"
    ) -> TokenLogprobs:
        return cls(
            chosen=torch.zeros(*leading, positions, dtype=torch.float64, device=device),
            top_ids=torch.zeros(*leading, positions, top, dtype=torch.long, device=device),
            top_logp=torch.zeros(*leading, positions, top, dtype=torch.float64, device=device),
        )

    def rows(self, b: torch.Tensor, j: torch.Tensor) -> TokenLogprobs:
        """Rows [b[i], j[i]] of a [B, W, T] table: [n, T]."""
        return TokenLogprobs(self.chosen[b, j], self.top_ids[b, j], self.top_logp[b, j])

    def reshape(self, *leading: int) -> TokenLogprobs:
        t, n = self.top_ids.shape[-2:]
        return TokenLogprobs(
            self.chosen.reshape(*leading, t),
            self.top_ids.reshape(*leading, t, n),
            self.top_logp.reshape(*leading, t, n),
        )


@dataclass
class Segment:
    """What one iteration added to some beams: the session and input row each descends from,
    and the log-probs of its new positions ([n, D + 1]; past a beam's new length: padding)."""

    session: torch.Tensor  # [n]
    root: torch.Tensor  # [n]
    values: TokenLogprobs


@dataclass
class IterationLogprobs:
    """The verifier's part of `Outcome`: the next input beams' segments ([B * W], row-major)
    and one segment per pool entry the iteration added, in the pool's order."""

    beams: Segment
    finished: list[Segment] = field(default_factory=list)


def splice(rows: TokenLogprobs, start: torch.Tensor, segment: Segment) -> TokenLogprobs:
    """Full rows [n, T]: each beam's input row with the segment written from position
    `start[session]` (the generated length before the iteration). Positions past the end are
    clamped onto the last one, T - 1, which no beam ever reaches (lengths <= max_new_tokens)."""
    base = rows.rows(segment.session, segment.root)
    chosen, ids, logp = base.chosen.clone(), base.top_ids.clone(), base.top_logp.clone()
    span = segment.values.chosen.shape[-1]
    last = chosen.shape[-1] - 1
    span_columns = torch.arange(span, device=chosen.device)
    pos = (start[segment.session][:, None] + span_columns).clamp(max=last)
    chosen.scatter_(1, pos, segment.values.chosen)
    wide = pos[:, :, None].expand_as(segment.values.top_ids)
    ids.scatter_(1, wide, segment.values.top_ids)
    logp.scatter_(1, wide, segment.values.top_logp)
    return TokenLogprobs(chosen, ids, logp)


class ForestLogprobTable:
    """The target's log-probs of one iteration (rows of the roots and of every forest layer),
    and the values of the tokens along any path through the forest."""

    def __init__(self, node_logp: list[torch.Tensor], layers: list[ForestLayer], top: int):
        self.node_logp = node_logp  # [B, W, V] at the roots, then [B, M_l, V] per layer
        self.layers = layers
        self.top = min(top, node_logp[0].shape[-1])  # a vocabulary smaller than N: all of it
        self._top: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _top_of(self, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-N ids and log-probs of every row of layer `level` ([B, M, N]), computed once."""
        if level not in self._top:
            found = self.node_logp[level].topk(self.top, dim=-1)
            self._top[level] = (found.indices, found.values.to(torch.float64))
        return self._top[level]

    def path_values(
        self, root: torch.Tensor, path: torch.Tensor, level: torch.Tensor, new_token: torch.Tensor
    ) -> TokenLogprobs:
        """Log-probs of the tokens of beams that run root -> path nodes at layers 1..level ->
        `new_token` (a child of the layer-`level` node): [B, n, D + 1], position k holding the
        token at forest depth k + 1. root: [B, n]; path: [B, n, D] (`beams.ancestry`);
        level: [B]; new_token: [B, n]."""
        batch, n = root.shape
        depth = len(self.layers)
        out = TokenLogprobs.zeros((batch, n), depth + 1, self.top)
        for k in range(int(level.max()) + 1):
            parent = root if k == 0 else path[:, :, k - 1].clamp(min=0)
            token = new_token
            if k < depth:
                on_path = self.layers[k].token.gather(1, path[:, :, k].clamp(min=0))
                token = torch.where((k < level)[:, None], on_path, new_token)
            rows = self.node_logp[k]
            vocab = rows.shape[-1]
            flat = rows.reshape(batch, -1).gather(1, parent * vocab + token)
            here = (k <= level)[:, None]
            out.chosen[:, :, k] = torch.where(here, flat.to(torch.float64), 0.0)
            if self.top:
                ids, logp = self._top_of(k)
                index = parent[:, :, None].expand(batch, n, self.top)
                out.top_ids[:, :, k] = ids.gather(1, index)
                out.top_logp[:, :, k] = logp.gather(1, index)
        return out


def segment_of(values: TokenLogprobs, root: torch.Tensor, mask: torch.Tensor) -> Segment:
    """The segment of the beams selected by `mask` [B, n] (in `mask.nonzero()` order, the order
    `beams.pool_add` adds them in)."""
    b, j = mask.nonzero(as_tuple=True)
    return Segment(session=b, root=root[b, j], values=values.rows(b, j))


def all_of(values: TokenLogprobs, root: torch.Tensor, order: torch.Tensor) -> Segment:
    """The segment of every slot [B, W] (row-major) once the slots are put in `order` (the
    next beams' order, `beams.NextBeams.order`); `root` is already in that order."""
    batch, width = root.shape
    index = order[:, :, None].expand_as(values.chosen)
    wide = order[:, :, None, None].expand_as(values.top_ids)
    values = TokenLogprobs(
        values.chosen.gather(1, index),
        values.top_ids.gather(1, wide),
        values.top_logp.gather(1, wide),
    )
    session = torch.arange(batch, device=root.device)[:, None].expand(batch, width).reshape(-1)
    return Segment(session=session, root=root.reshape(-1), values=values.reshape(batch * width))


def prefix_logprobs(
    rows: TokenLogprobs | None,
    alive: torch.Tensor,
    pool_session: list[torch.Tensor],
    pool_rows: list[TokenLogprobs],
    count: int,
) -> TokenLogprobs | None:
    """Log-probs of the first `count` generated tokens of session 0, which every candidate
    (live beam or pooled one) shares (a stream's committed prefix): taken from any candidate,
    since beams inherit the values of the prefix from their common ancestor."""
    if rows is None:
        return None
    live = alive[0].nonzero().flatten()
    pick: TokenLogprobs | None
    if live.numel():
        pick = rows.rows(torch.zeros(1, dtype=torch.long, device=live.device), live[:1])
    else:
        pick = None
        for sessions, entry in zip(pool_session, pool_rows, strict=True):
            hit = (sessions == 0).nonzero().flatten()
            if hit.numel():
                pick = TokenLogprobs(
                    entry.chosen[hit[:1]], entry.top_ids[hit[:1]], entry.top_logp[hit[:1]]
                )
                break
        if pick is None:
            return None
    return TokenLogprobs(pick.chosen[0, :count], pick.top_ids[0, :count], pick.top_logp[0, :count])


def beam_lists(
    values: TokenLogprobs, index: int, length: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """One pooled beam's log-probs as Python lists: per token its own, and its alternatives."""
    chosen = values.chosen[index, :length].tolist()
    ids = values.top_ids[index, :length].tolist()
    logp = values.top_logp[index, :length].tolist()
    tops = [list(zip(i, p, strict=True)) for i, p in zip(ids, logp, strict=True)]
    return chosen, tops
