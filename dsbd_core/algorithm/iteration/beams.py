"""Beams through the forest: the paths of forest nodes, the next input beams, the finished pool.

After verification an iteration's output beams are children of nodes somewhere in the forest.
These functions turn (layer, node) references into token sequences, choose the rows the next
iteration starts from (and the `Origin` the models compact their KV caches with), and move
beams that left decoding to the pool. All batched over sessions; loops run over forest layers
only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsbd_core.algorithm.draws.distributions import NEG_INF
from dsbd_core.algorithm.draws.host_reads import may_read
from dsbd_core.algorithm.scorer import ForestLayer, Origin
from dsbd_core.algorithm.sequences.logprobs import (
    ForestLogprobTable,
    IterationLogprobs,
    Segment,
    all_of,
    segment_of,
)
from dsbd_core.algorithm.sequences.state import DecodeState, Outcome, Pool

if TYPE_CHECKING:
    from dsbd_core.algorithm.sequences.stops import StopStrings


@dataclass
class Outputs:
    """Output slots of the current iteration, filled layer by layer as sessions stop verifying."""

    layer: torch.Tensor  # [B] forest layer of the output beams' parents
    index: torch.Tensor  # [B, W] flat candidate index (parent * V + token)
    exists: torch.Tensor  # [B, W]
    score: torch.Tensor  # [B, W] true log-likelihood of the output beam

    @classmethod
    def empty(cls, batch: int, width: int, device: torch.device) -> Outputs:
        return cls(
            layer=torch.zeros(batch, dtype=torch.long, device=device),
            index=torch.zeros(batch, width, dtype=torch.long, device=device),
            exists=torch.zeros(batch, width, dtype=torch.bool, device=device),
            score=torch.zeros(batch, width, dtype=torch.float64, device=device),
        )

    def set(
        self,
        sessions: torch.Tensor,
        layer: int,
        index: torch.Tensor,
        exists: torch.Tensor,
        score: torch.Tensor,
    ) -> None:
        """Record the output slots of `sessions`: children of forest layer `layer` at `index`
        with true log-likelihoods `score`. Selected with `where`, not a boolean index (which
        would read the mask on the host: a wait for a GPU)."""
        rows = sessions[:, None]
        self.layer = torch.where(sessions, layer, self.layer)
        self.index = torch.where(rows, index, self.index)
        self.exists = torch.where(rows, exists, self.exists)
        self.score = torch.where(rows, score, self.score)


def ancestry(
    layers: list[ForestLayer], level: torch.Tensor, node: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Root row and per-layer node index (-1 above `level`) of every given node."""
    batch, n = node.shape
    path = torch.full((batch, n, len(layers)), -1, dtype=torch.long, device=node.device)
    current = node.clone()
    for lv in range(len(layers), 0, -1):
        here = (level >= lv)[:, None].expand(batch, n)
        path[:, :, lv - 1] = torch.where(here, current, -1)
        parents = layers[lv - 1].parent
        up = parents.gather(1, current.clamp(max=parents.shape[1] - 1))
        current = torch.where(here, up, current)
    return current, path


def sequences(
    tokens: torch.Tensor,
    length: torch.Tensor,
    layers: list[ForestLayer],
    level: torch.Tensor,
    node: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences through forest nodes: root tokens ++ path tokens (layers 1..level).

    level: [B] the nodes' layer (0 = roots); node: [B, n] node indices in that layer.
    Returns (tokens [B, n, L], length [B]).
    """
    root, path = ancestry(layers, level, node)
    batch, n = node.shape
    seq = tokens.gather(1, root[:, :, None].expand(-1, -1, tokens.shape[2])).clone()
    for lv in range(1, len(layers) + 1):
        here = level >= lv
        tok = layers[lv - 1].token.gather(1, path[:, :, lv - 1].clamp(min=0))
        pos = (length + lv - 1).clamp(max=tokens.shape[2] - 1)
        current = seq.gather(2, pos[:, None, None].expand(batch, n, 1))[:, :, 0]
        value = torch.where(here[:, None], tok, current)
        seq.scatter_(2, pos[:, None, None].expand(batch, n, 1), value[:, :, None])
    return seq, length + level


def layer_stopped(
    state: DecodeState, layers: list[ForestLayer], level: int, stop: StopStrings
) -> torch.Tensor:
    """Which nodes of forest layer `level` finished by a stop string [B, n]: their text holds
    one (their parents' did not)."""
    node = layers[level - 1].token
    at = torch.full((node.shape[0],), level, dtype=torch.long, device=node.device)
    index = torch.arange(node.shape[1], device=node.device).expand_as(node)
    seq, seq_len = sequences(state.tokens, state.length, layers, at, index)
    return stop.finished(seq, seq_len, state.prompt_len)


def finds_rows(mask: torch.Tensor, rows_needed: bool) -> bool:
    """Whether the beams leaving under `mask` are found by reading it (`pool_add`'s
    `compact`): where the read costs nothing (the host), or where their rows are needed one by
    one (log-probs follow the pooled rows); else they go to the pool under the mask."""
    return rows_needed or may_read(mask)


def pool_add(
    pool: Pool,
    seq: torch.Tensor,
    seq_len: torch.Tensor,
    prompt_len: torch.Tensor,
    score: torch.Tensor,
    mask: torch.Tensor,
    finished: bool,
    max_new_tokens: int,
    *,
    compact: bool = True,
) -> None:
    """Move the beams selected by `mask` [B, n] to the pool (generated tokens only).

    `compact`: only the selected rows (finding them reads the mask: a wait on a GPU); else
    every row with `mask` as its `Pool.kept` flag, to be dropped on the host at the end."""
    if compact:
        b, j = mask.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        kept = torch.ones_like(b, dtype=torch.bool)
    else:
        batch, n = mask.shape
        b = torch.arange(batch, device=mask.device).repeat_interleave(n)
        j = torch.arange(n, device=mask.device).repeat(batch)
        kept = mask.reshape(-1)
    # Independent of gamma (a controller may change it per iteration): no beam grows past
    # the budget, since an iteration's depth is capped at the budget left minus one.
    span = max_new_tokens + 1
    span_columns = torch.arange(span, device=seq.device)
    offset = (prompt_len[b][:, None] + span_columns).clamp(max=seq.shape[2] - 1)
    pool.session.append(b)
    pool.tokens.append(seq[b, j].gather(1, offset))
    pool.length.append(seq_len[b] - prompt_len[b])
    pool.score.append(score[b, j])
    pool.finished.append(torch.full_like(b, finished, dtype=torch.bool))
    pool.kept.append(kept)


@dataclass
class NextBeams:
    """The next iteration's input beams (what `Outcome` carries of them)."""

    tokens: torch.Tensor
    length: torch.Tensor
    score: torch.Tensor
    alive: torch.Tensor
    remaining: torch.Tensor
    origin: Origin
    order: torch.Tensor  # [B, W] the output slot each next beam comes from
    finished: torch.Tensor  # [B, W] the output slots that went to the pool (EOS or stop)


def next_beams(
    tokens: torch.Tensor,
    length: torch.Tensor,
    prompt_len: torch.Tensor,
    layers: list[ForestLayer],
    out: Outputs,
    remaining: torch.Tensor,
    live: torch.Tensor,
    pool: Pool,
    *,
    vocab: int,
    eos: torch.Tensor,
    lean_memory: bool,
    max_new_tokens: int,
    rows_needed: bool = False,
    stop: StopStrings | None = None,
) -> NextBeams:
    """Turn the output slots into the next iteration's input beams.

    Output beams that end in an EOS token (or whose text holds a `stop` string) go to
    `pool`; the others are packed to the front of
    the rows (lean memory: only the most likely one is kept, ALGORITHM.md §7). `rows_needed`: their
    log-probs follow the pooled rows (`finds_rows`).
    """
    batch, width = out.index.shape
    parent, new_token = out.index // vocab, out.index % vocab
    root, path = ancestry(layers, out.layer, parent)
    seq, seq_len = sequences(tokens, length, layers, out.layer, parent)
    seq.scatter_(2, seq_len[:, None, None].expand(batch, width, 1), new_token[:, :, None])
    seq_len = torch.where(live, seq_len + 1, length)
    exists = out.exists & live[:, None]
    finished = exists & torch.isin(new_token, eos)
    if stop is not None:
        finished = finished | (exists & stop.finished(seq, seq_len, prompt_len))
    compact = finds_rows(finished, rows_needed)
    if not compact or bool(finished.any()):
        pool_add(
            pool,
            seq,
            seq_len,
            prompt_len,
            out.score,
            finished,
            True,
            max_new_tokens,
            compact=compact,
        )
    keep = exists & ~finished
    if lean_memory:
        # Keep the most likely output beam (lowest perplexity; ALGORITHM.md §14.4): one KV row.
        best = out.score.masked_fill(~exists, NEG_INF).argmax(dim=1)
        best_alive = keep.gather(1, best[:, None])[:, 0]
        order = torch.arange(width, device=best.device)[None, :].expand(batch, width)
        order = torch.where(order == 0, best[:, None], order)
        keep = torch.zeros_like(keep)
        keep[:, 0] = best_alive
        # Within an iteration finished beams spend width as in full mode; the one kept beam
        # starts the next iteration with the full width again.
        remaining = torch.where(live, torch.where(best_alive, width, 0), remaining)
    else:
        order = keep.long().argsort(dim=1, descending=True, stable=True)
        keep = keep.gather(1, order)
        remaining = remaining - finished.sum(dim=1)
    seq = seq.gather(1, order[:, :, None].expand_as(seq))
    new_score = out.score.gather(1, order)
    path = path.gather(1, order[:, :, None].expand_as(path))
    origin = Origin(root=root.gather(1, order), path=path)
    untouched = ~live
    seq = torch.where(untouched[:, None, None], tokens, seq)
    new_score = torch.where(keep, new_score, 0.0)
    return NextBeams(seq, seq_len, new_score, keep, remaining, origin, order, finished)


def node_logprobs(table: ForestLogprobTable, level: int, mask: torch.Tensor) -> Segment:
    """Log-probs of the forest nodes of layer `level` selected by `mask` [B, M] (accepted
    drafts that finished: the pool entries `pool_add` makes of them, in its order)."""
    layer = table.layers[level - 1]
    at = torch.full((layer.token.shape[0],), level - 1, dtype=torch.long, device=mask.device)
    return path_logprobs(table, at, layer.parent, layer.token, mask)


def path_logprobs(
    table: ForestLogprobTable,
    level: torch.Tensor,
    parent: torch.Tensor,
    token: torch.Tensor,
    mask: torch.Tensor,
) -> Segment:
    """Log-probs of the candidates (node `parent` [B, n] of layer `level` [B], `token`)
    selected by `mask` (in `pool_add`'s order)."""
    root, path = ancestry(table.layers, level, parent)
    return segment_of(table.path_values(root, path, level, token), root, mask)


def slot_logprobs(
    table: ForestLogprobTable,
    out: Outputs,
    beams: NextBeams,
    finished: torch.Tensor,
    vocab: int,
) -> tuple[Segment, Segment | None]:
    """Log-probs of the output slots: of the next input beams (`beams`, from `next_beams`), and
    of the slots in `finished` [B, W] that went to the pool (in `pool_add`'s order), if any."""
    parent, new_token = out.index // vocab, out.index % vocab
    root, path = ancestry(table.layers, out.layer, parent)
    values = table.path_values(root, path, out.layer, new_token)
    done = segment_of(values, root, finished) if bool(finished.any()) else None
    return all_of(values, beams.origin.root, beams.order), done


def walk_outcome(
    beams: NextBeams,
    *,
    emitted: torch.Tensor,
    finished: Pool,
    passed_layers: torch.Tensor,
    widths: list[torch.Tensor],
    alphas: list[torch.Tensor],
    counters: dict[str, torch.Tensor],
    logprobs: IterationLogprobs | None,
    finished_scores: torch.Tensor | None = None,
) -> Outcome:
    """The outcome of a walk over the forest (sampling verification or beam search): the
    same fields from the same places, so the two walks cannot drift apart. `widths` and
    `alphas` hold one [B] tensor per verified layer (beam search has no alphas)."""
    empty = torch.empty(passed_layers.shape[0], 0, device=passed_layers.device)
    return Outcome(
        tokens=beams.tokens,
        length=beams.length,
        score=beams.score,
        alive=beams.alive,
        remaining=beams.remaining,
        origin=beams.origin,
        emitted=emitted,
        finished=finished,
        record={
            "accepted_layers": passed_layers,
            "widths": torch.stack(widths, dim=1) if widths else empty,
            "alphas": torch.stack(alphas, dim=1) if alphas else empty,
        },
        counters=counters,
        logprobs=logprobs,
        finished_scores=finished_scores,
    )
