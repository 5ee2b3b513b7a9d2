"""One DSBD iteration for one session, read top to bottom: the reading path, not the served path.

Dynamic-Width Speculative Beam Decoding (Qin et al., arXiv 2409.16560): its draft and
verification scheme (Algorithm 1, Eq. 3, Theorem 3.1) and its dynamic width. The terms:

* forest: what the draft proposes in one iteration, beam sampling of *draft width* W_S for
  *gamma* layers from the session's beams. Layer l holds W_S drafts, each a candidate (parent in
  layer l - 1, token) drawn from the draft's table Q_l; layer 0 is the beams themselves.
* layer: the target verifies the forest one layer at a time against P_l, its own beam-sampling
  table over that layer's (parent x token) candidates.
* width K: the acceptances a layer needs to pass, at most the width left R (the beam width W less
  the beams that finished). *threshold* t: the dynamic width, K = the largest k with
  Pr[at least k drafts accepted] >= t; t = None keeps K = R, which is exactly beam sampling.
* residual: after a rejected draft the chain c moves to norm((c - q)_+), the mass of c the draft's
  proposal q did not cover (Eq. 3's rejection branch); so every output slot is a draw from P_l.

The engine (`engine.py`) serves this iteration batched over sessions, with masks where they differ;
docs/ALGORITHM.md §2-§5 gives its details and decisions. tests/algorithm/test_reference_iteration.py
checks that this module decodes the engine's tokens draw for draw: it draws the same counters
(`streams.py`: its one session is the engine's row 0; a layer's table has a row per slot, empty
ones included, W in the first layer, W_S after) and calls the engine's pure helpers for the
filter, the draws, the residual and the width rule. It covers both modes, fixed and dynamic
width, the filters, lean memory and
epsilon; not several sessions at once, a draft head restricted to K tokens, log-probs or beam
search; it agrees for float64 models (the engine shifts float32 tables).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.draws.distributions import (
    draw_distinct,
    draw_with_replacement,
    joint_filter,
    normalise,
    residual,
)
from dsbd_core.algorithm.draws.streams import (
    ACCEPT,
    BONUS,
    DRAFT,
    FILL,
    REFILL,
    WIDTH,
    Draws,
    Streams,
)
from dsbd_core.algorithm.engine import DRAFT_STREAM, VERIFY_STREAM
from dsbd_core.algorithm.iteration.width import layer_width
from dsbd_core.algorithm.iteration.width_distinct import distinct_layer_width

Model = Callable[[list[int]], Tensor]
"""A model as the reference sees it: a token sequence -> next-token log-probabilities [V]."""
Path = list[int] | None  # a row's token sequence; None: no row there (empty slot, no children)
Slot = tuple[int, bool]  # an output slot: (candidate index parent * V + token, exists)


@dataclass
class Beam:
    """A sequence and its score (the engine's rows of `tokens` and `score`)."""

    tokens: list[int]  # prompt + generated tokens
    score: float  # true target log-likelihood of the generated tokens


@dataclass
class Session:
    """One prompt's decode between iterations (the engine's `DecodeState`, one row)."""

    prompt_len: int
    beams: list[Beam]  # the live beams, in slot order
    remaining: int  # the width left R: W minus the beams that finished
    seed: int
    iteration: int = 0
    pool: list[tuple[Beam, bool]] = field(default_factory=list)  # (beam, finished at EOS)
    history: list[tuple[int, list[int]]] = field(default_factory=list)  # (passed, widths) each


@dataclass
class Layer:
    """One forest layer: W_S drafts from the draft's table Q over (parents x V)."""

    index: Tensor  # [W_S] each draft's candidate in Q: parent row * V + token
    exists: Tensor  # [W_S] False: Q had no mass left to draw
    table: Tensor  # Q [parents * V]
    prob: Tensor  # [W_S] each draft's exact draw probability (distinct: given the earlier)
    paths: list[Path]  # each draft's whole token sequence


def reference_decode(
    prompt: list[int], target: Model, draft: Model, config: SamplingConfig, vocab: int
) -> Session:
    """Iterations until no beam or token budget is left, as the engine plans them; the pool
    then holds every beam."""
    assert config.seed is not None, "the reference replays a seeded decode"
    session = Session(len(prompt), [Beam(list(prompt), 0.0)], config.width, config.seed)
    while session.beams:
        budget = config.max_new_tokens - (len(session.beams[0].tokens) - session.prompt_len)
        if budget <= 0:  # the beams leave unfinished
            session.pool += [(beam, False) for beam in session.beams]
            break
        depth = min(config.gamma, budget - 1)  # an iteration emits at most depth + 1 tokens
        session.history.append(reference_iteration(session, target, draft, config, vocab, depth))
    return session


def reference_iteration(
    session: Session, target: Model, draft: Model, config: SamplingConfig, vocab: int, depth: int
) -> tuple[int, list[int]]:
    """Draft `depth` layers, verify them, and move `session` on to the output beams (those
    ending in EOS go to the pool). Returns the layers that passed and each verified width."""
    forest = draft_forest(session, draft, config, vocab, depth)
    outputs, passed, widths = verify_forest(session, target, forest, config, vocab)
    ended = [beam.tokens[-1] in config.eos_token_ids for beam in outputs]
    session.pool += [(beam, True) for beam, end in zip(outputs, ended, strict=True) if end]
    if config.lean_memory and outputs:  # keep the likeliest output only: one KV row
        best = max(range(len(outputs)), key=lambda i: outputs[i].score)
        session.beams = [] if ended[best] else [outputs[best]]
        session.remaining = config.width if session.beams else 0
    else:
        session.beams = [beam for beam, end in zip(outputs, ended, strict=True) if not end]
        session.remaining -= sum(ended)
    session.iteration += 1
    return passed, widths


def draft_forest(
    session: Session, draft: Model, config: SamplingConfig, vocab: int, depth: int
) -> list[Layer]:
    """Beam sampling with the draft, W_S wide, from the beams' *target* scores (so a draft
    equal to the target proposes exactly P_l); one draft call per layer."""
    streams = Streams.side(session.seed, session.iteration, DRAFT_STREAM)
    paths, score = _roots(session, config.width)
    forest: list[Layer] = []
    distinct = config.mode == "distinct"
    for level in range(1, depth + 1):
        logq = _rows(draft, paths, vocab)
        table = candidate_table(score, logq, paths, config)  # Q_l
        rng = streams.at(level, DRAFT)
        index, prob, exists = sample(table, config.effective_draft_width, distinct, rng)
        parent, token = index // vocab, index % vocab
        score = torch.where(exists, score[parent] + logq[parent, token], 0.0)
        rows = zip(parent.tolist(), token.tolist(), exists.tolist(), strict=True)
        drafted = [paths[p] + [t] if e else None for p, t, e in rows]
        forest.append(Layer(index, exists, table, prob, drafted))
        ends = config.eos_token_ids  # a draft ending in EOS has no children
        paths = [path if path is not None and path[-1] not in ends else None for path in drafted]
    return forest


def verify_forest(
    session: Session, target: Model, forest: list[Layer], config: SamplingConfig, vocab: int
) -> tuple[list[Beam], int, list[int]]:
    """The layers in order (the target's log-probs at every node are one forward in the engine):
    the first layer that fails, or the bonus layer after the last, gives the output beams.
    Returns (outputs, layers passed, widths)."""
    streams = Streams.side(session.seed, session.iteration, VERIFY_STREAM)
    width, distinct = config.width, config.mode == "distinct"
    paths, score = _roots(session, width)
    widths: list[int] = []
    for level, layer in enumerate([*forest, None], start=1):
        logp = _rows(target, paths, vocab)
        p = candidate_table(score, logp, paths, config)  # P_l
        if layer is None:  # every drafted layer passed: a bonus layer, a beam-sampling step
            slots, passed = _slots(p, width, distinct, streams.at(level, BONUS)), level - 1
            break
        valid = torch.tensor([path is not None for path in paths]).repeat_interleave(vocab)
        k = choose_width(p, layer, valid, session.remaining, config, streams.at(level, WIDTH))
        widths.append(k)
        accepted, chain, chosen = accept_drafts(
            p, layer, valid, k, config, streams.at(level, ACCEPT)
        )
        if len(accepted) < k:  # failed: accepted drafts, one draw from the chain, fresh from P_l
            rng = streams.at(level, FILL)
            fallback, _, found = sample(chain, 1, False, rng)
            slots = [(int(layer.index[j]), True) for j in accepted] + [(int(fallback), bool(found))]
            if distinct:  # the fresh draws exclude every candidate taken already
                taken = chosen.clone()
                taken[fallback] = found
                p = p * ~taken
            slots, passed = slots + _slots(p, width, distinct, rng), level - 1
            break
        # passed: accepted drafts ending in EOS leave (and take their slot), the rest are parents
        parent, token = layer.index // vocab, layer.index % vocab
        node_score = score[parent] + logp[parent, token]
        ended = [j for j in accepted if int(token[j]) in config.eos_token_ids]
        session.pool += [(Beam(layer.paths[j] or [], float(node_score[j])), True) for j in ended]
        session.remaining -= len(ended)
        if len(ended) == len(accepted):  # all of them finished: fill the width left from P_l
            rest = p * ~chosen if distinct else p
            slots, passed = _slots(rest, width, distinct, streams.at(level, REFILL)), level
            break
        parents = set(accepted) - set(ended)
        paths = [path if j in parents else None for j, path in enumerate(layer.paths)]
        score = node_score
    # the output beams: the candidates of P_l in the open slots (the first R that exist)
    rows = [divmod(index, vocab) for index, exists in slots[: session.remaining] if exists]
    outputs = [Beam(paths[r] + [t], float(score[r] + logp[r, t])) for r, t in rows]  # type: ignore[operator]  # rows are parents': each has a path
    return outputs, passed, widths


def choose_width(
    p: Tensor, layer: Layer, valid: Tensor, remaining: int, config: SamplingConfig, rng: Draws
) -> int:
    """K, from P_l and Q_l only (never from the drafts' uniforms, which keeps each slot exact):
    the width left, or the threshold rule on the distribution of the acceptance count."""
    if config.threshold is None:
        return remaining
    args = (layer.exists.sum()[None], len(layer.index), config.threshold, config.w_min)
    left = torch.tensor([remaining])
    if config.mode == "distinct":  # Pr[N >= k] of the without-replacement rule, simulated
        rows = None if bool(valid.all()) else valid[None]
        return int(distinct_layer_width(p[None], layer.table[None], rows, *args, left, rng)[0])
    return int(layer_width(p[None], (layer.table * valid)[None], *args, left)[0])  # the DP


def accept_drafts(
    p: Tensor, layer: Layer, valid: Tensor, k: int, config: SamplingConfig, rng: Draws
) -> tuple[list[int], Tensor, Tensor]:
    """The acceptance chain (Eq. 3) over the layer's drafts in draw order, until K accepted.
    Returns the accepted drafts, the final chain and the candidates chosen."""
    distinct = config.mode == "distinct"
    u = rng.uniform((1, len(layer.index)), p.dtype, p.device)[0]  # before K is used
    q_left = layer.table * valid  # Q~: a draft of a rejected parent is never accepted
    chain, p_left = p, p.clone()  # p_left (distinct): P without the candidates chosen
    chosen = torch.zeros_like(p, dtype=torch.bool)
    drafted = 0.0  # distinct: the draft mass of the earlier drafts
    accepted: list[int] = []
    for j, d in enumerate(layer.index.tolist()):
        if len(accepted) == k:
            break
        if not layer.exists[j]:
            continue
        # the proposal this draft came from: Q~, distinct: without the earlier drafts
        q = q_left / max(1.0 - drafted, 1e-300) if distinct else q_left
        over = config.epsilon * float(p[d] > 0)  # lossy opt-in (0: exact)
        parent_ok = bool(valid[d])  # else rejected: the chain moves to the residual all the same
        if parent_ok and u[j] < (chain[d] + over) / layer.prob[j].clamp_min(1e-300):
            accepted.append(j)
            chosen[d] = True
            p_left[d] = 0.0
            chain = normalise(p_left[None])[0] if distinct else p  # a fresh chain from P
        else:
            chain = residual(chain[None], q[None])[0]  # the residual: P's mass q did not cover
        if distinct:
            drafted += float(layer.table[d])
            q_left[d] = 0.0
    return accepted, chain, chosen


def candidate_table(
    score: Tensor, logp: Tensor, paths: list[Path], config: SamplingConfig
) -> Tensor:
    """Beam sampling's table over (row, token), flat index row * V + token: the joint filter of
    score(row) + log p(token | row); rows without a beam get nothing."""
    rows = torch.tensor([path is not None for path in paths])
    weights = torch.where(rows[:, None], score[:, None] + logp, float("-inf")).flatten()
    return joint_filter(weights[None], config.temperature, config.top_k, config.top_p)[0]


def sample(weights: Tensor, n: int, distinct: bool, rng: Draws) -> tuple[Tensor, Tensor, Tensor]:
    """n draws: (index, draw probability, exists). distinct: sequentially without replacement
    (the probability given the earlier draws), else i.i.d."""
    if distinct:
        index, prob, exists = (x[0] for x in draw_distinct(weights[None], n, rng))
        return index, prob, exists
    index, exists = (x[0] for x in draw_with_replacement(weights[None], n, rng))
    return index, weights[index], exists


def _slots(weights: Tensor, n: int, distinct: bool, rng: Draws) -> list[Slot]:
    """n output slots drawn from `weights` (P_l, or what is left of it)."""
    index, _, exists = sample(weights, n, distinct, rng)
    return list(zip(index.tolist(), exists.tolist(), strict=True))


def _roots(session: Session, width: int) -> tuple[list[Path], Tensor]:
    """The beams as W rows (empty slots included: the engine's layout, which the draws see)."""
    empty = width - len(session.beams)
    paths = [beam.tokens for beam in session.beams] + [None] * empty
    scores = [beam.score for beam in session.beams] + [0.0] * empty
    return paths, torch.tensor(scores, dtype=torch.float64)


def _rows(model: Model, paths: list[Path], vocab: int) -> Tensor:
    """The model's next-token log-probs at every row [rows, V] (zeros where there is none)."""
    none = torch.zeros(vocab, dtype=torch.float64)
    return torch.stack([model(path) if path is not None else none for path in paths])
