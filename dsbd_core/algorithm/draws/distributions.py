"""Candidate distributions and exact draws, batched over sessions.

A *candidate table* is a [B, N] tensor over N = (#parent beams x |V|) candidates, flattened
row-major (`parent * V + token`, ALGORITHM.md §0.2). Beam sampling, the draft's proposals and DSBD's
target layer distributions are all built by `joint_filter`, so the three agree whenever the
models agree (ALGORITHM.md §11.2).
"""

from __future__ import annotations

import torch

from dsbd_core.algorithm.draws.host_reads import may_read
from dsbd_core.algorithm.draws.streams import Uniforms

NEG_INF = float("-inf")
# Below this mass a residual is treated as empty: a rejection that needs it happens with
# probability < 1e-12, so any finite fallback keeps the sampler exact to that precision.
RESIDUAL_EPS = 1e-12


def joint_filter(
    log_weights: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """The joint beam distribution over a candidate table (ALGORITHM.md §1.1 step 2).

    log_weights: [B, N] log-weights (`-inf` excludes a candidate). Temperature divides them;
    top-k keeps the k largest of the whole row (ties with the k-th kept); top-p keeps the
    smallest prefix (by descending probability, ties by index) whose mass reaches `top_p`,
    including the entry that crosses it. Rows without any finite entry come back all zero.
    """
    x = log_weights / temperature if temperature != 1.0 else log_weights
    n = x.shape[-1]
    if 0 < top_k < n:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    if top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        sorted_p = _safe_softmax(sorted_x)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, NEG_INF)
    return _safe_softmax(x)


def _safe_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax that maps an all `-inf` row to zeros instead of NaN.

    The common case (every row has a finite entry) is one softmax; only a batch with an empty
    row pays for the masking.
    """
    if may_read(x) and bool(torch.isfinite(x.amax(dim=-1)).all()):
        return torch.softmax(x, dim=-1)
    has_mass = torch.isfinite(x).any(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(has_mass, x, torch.zeros_like(x)), dim=-1)
    return probs * has_mass


def normalise(weights: torch.Tensor) -> torch.Tensor:
    """Rows divided by their sums; rows without mass stay zero."""
    total = weights.sum(dim=-1, keepdim=True)
    if may_read(total) and bool((total > 0).all()):
        return weights / total  # the common case: one pass instead of three
    return torch.where(total > 0, weights / total.clamp_min(1e-300), torch.zeros_like(weights))


def residual(chain: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """norm((chain - proposal)_+): the chain's distribution after a rejection (ALGORITHM.md §4.2).

    `proposal` may be sub-stochastic (rows of rejected parents removed). When the residual has
    no mass the chain is returned unchanged (ALGORITHM.md §11.15): that branch has probability ~0.
    """
    rest = (chain - proposal).clamp_min_(0.0)
    total = rest.sum(dim=-1, keepdim=True)
    if may_read(total) and bool((total > residual_eps(chain.dtype)).all()):
        return rest.div_(total)
    return torch.where(total > residual_eps(chain.dtype), rest / total.clamp_min(1e-300), chain)


def residual_eps(dtype: torch.dtype) -> float:
    """Below this mass a residual is treated as empty: a rejection that needs it happens with
    probability below it, so any finite fallback keeps the sampler exact to that precision.
    float32 tables (bfloat16 and float32 models) sum their rounding errors to ~1e-7 where the
    two distributions agree, so the bar is higher there than in float64."""
    return RESIDUAL_EPS if dtype == torch.float64 else 1e-6


Source = Uniforms  # what every draw takes its numbers from (`streams.Draws`)


def uniform(
    source: Source, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Uniform numbers in (0, 1) from `source`: every draw of the engine is a function of
    these (inverse transform, acceptance tests), nothing draws on its own."""
    return source.uniform(shape, dtype, device)


def draw_with_replacement(
    probs: torch.Tensor, n: int, source: Source
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` i.i.d. draws per row by inverse transform. Returns (index [B, n], exists [B, n]);
    rows without mass give exists=False.

    The first index whose float64 running mass exceeds u * total: exact as `torch.multinomial`
    is, 8x cheaper on a 3 x 151936 candidate table, and a function of uniforms (so a compiled
    step can take them as an input)."""
    has_mass = probs.sum(dim=-1) > 0
    everywhere = may_read(has_mass) and bool(has_mass.all())
    safe = probs if everywhere else torch.where(has_mass[:, None], probs, 1.0)
    cumulative = torch.cumsum(safe, dim=-1, dtype=torch.float64)  # a new tensor: probs stay
    total = cumulative[:, -1:]
    u = uniform(source, (probs.shape[0], n), torch.float64, probs.device)
    index = torch.searchsorted(cumulative, u * total, right=True).clamp_(max=probs.shape[-1] - 1)
    return index, has_mass[:, None].expand(-1, n).clone()


def draw_distinct(
    probs: torch.Tensor, n: int, source: Source
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` draws per row sequentially without replacement, each by inverse transform over
    the candidates not drawn yet.

    Draw j has the conditional probability `p(d_j) / (1 - sum_{i<j} p(d_i))`, returned as the
    exact proposal probability DSBD's distinct-beam verification needs (ALGORITHM.md §4.5).
    Draws past the number of candidates with mass get exists=False.
    Returns (index [B, n], conditional probability [B, n], exists [B, n]).

    One float64 running mass serves every draw: with the drawn candidates r_1 < ... < r_k
    (masses m_1..m_k, prefix sums M_s) removed, the running mass left at a candidate between
    r_s and r_{s+1} is C(i) - M_s, so draw j searches C for u * (mass left) + M_s in each of
    the j + 1 gaps and takes the first gap where the candidate found lies inside. The noise is
    n uniforms a row, not one per candidate (a Gumbel top-k needs the whole table's worth).
    """
    batch, size = probs.shape
    device = probs.device
    cumulative = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # a new tensor: probs stay
    total = cumulative[:, -1:]
    u = uniform(source, (batch, n), torch.float64, device)
    index = torch.zeros(batch, n, dtype=torch.long, device=device)
    exists = torch.zeros(batch, n, dtype=torch.bool, device=device)
    mass = torch.zeros(batch, n, dtype=torch.float64, device=device)
    edge = torch.full((batch, 1), size, dtype=torch.long, device=device)
    for j in range(n):
        removed, order = index[:, :j].sort(dim=1)
        before = torch.cat([mass.new_zeros(batch, 1), mass[:, :j].gather(1, order).cumsum(1)], 1)
        left = total - before[:, -1:]
        found = torch.searchsorted(cumulative, u[:, j : j + 1] * left + before, right=True)
        found = torch.maximum(found, torch.cat([edge.new_zeros(batch, 1), removed + 1], 1))
        inside = found < torch.cat([removed, edge], 1)
        choice = found.gather(1, inside.to(torch.int8).argmax(dim=1, keepdim=True))
        choice = choice.clamp_(max=size - 1)
        drawn = inside.any(dim=1, keepdim=True) & (left > 0) & (probs.gather(1, choice) > 0)
        if j > 0:
            drawn &= exists[:, j - 1 : j]
        index[:, j : j + 1] = choice
        exists[:, j : j + 1] = drawn
        mass[:, j : j + 1] = torch.where(drawn, probs.gather(1, choice).to(torch.float64), 0.0)
    p = torch.where(exists, probs.gather(1, index), 0.0)
    mass_before = p.cumsum(dim=-1) - p
    conditional = p / (1.0 - mass_before).clamp_min(1e-300)
    return index, conditional, exists


def draw_one(probs: torch.Tensor, source: Source) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row: (index [B], exists [B])."""
    index, exists = draw_with_replacement(probs, 1, source)
    return index[:, 0], exists[:, 0]
