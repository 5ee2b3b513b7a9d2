"""Exact layer-by-layer verification of a draft layer against the target (ALGORITHM.md §4.2, §4.5).

One call verifies one forest layer for every session of the batch at once; the only Python loop
is over the (at most W_S) drafts of the layer, in draw order. Two exact rules:

* with_replacement (drafts i.i.d. from Q): accept d_j w.p. min(1, c(d_j)/Q(d_j)); on accept
  reset the chain c to P, on reject c <- norm((c - Q~)_+). Every output slot is then an i.i.d.
  draw from P, whether the layer passes or fails (ALGORITHM.md §4.4 lemma).
* distinct (drafts sequentially without replacement): the same chain with the conditional
  proposal q^(j) = norm(Q without d_1..d_{j-1}) and base(P) = norm(P without the chosen
  candidates) as the reset, so the slots are an ordered without-replacement sample of P (§4.5).

Drafts whose parent was rejected are auto-rejected with a residual update against Q~, the
proposal restricted to valid parents (not renormalised); that keeps both rules exact (§4.2).

Opt-in lossy mode (`epsilon` > 0, SamplingConfig.epsilon; THEORY.md §5.4, §9.3 item 6):
a draft d is accepted w.p. min(1, (c(d) + ε·[P(d) > 0]) / q(d)) — over-acceptance only inside
the support of the layer's target P, so filtered-out candidates are never emitted — and the
chain still moves to the ordinary residual on rejection (Decoding-OPT, Pareto-optimal). Each
executed stage then differs from the exact decision with probability
beta = Σ_x min(ε·[P(x) > 0], (q(x) - c(x))_+); `LayerVerdict.bias` sums it (docs/THEORY.md).
With ε = 0 nothing of this runs and the random draws are exactly those of the exact verifier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsbd_core.algorithm.draws.distributions import (
    Source,
    draw_distinct,
    draw_one,
    draw_with_replacement,
    normalise,
    residual,
    uniform,
)
from dsbd_core.algorithm.draws.host_reads import may_read


@dataclass
class LayerVerdict:
    """Outcome of verifying one layer.

    accepted: [B, m] bool — drafts accepted, in draw order.
    count: [B] long — number accepted (<= the layer width K).
    chain: [B, N] the chain state after the last processed draft (P after an acceptance, a
           residual after a rejection): the fallback distribution of the first open slot.
    chosen: [B, N] bool — candidates taken so far (distinct mode excludes them from later draws).
    bias: [B] sum over the executed stages of the ε rule's decision bias beta (0 when ε = 0).
    """

    accepted: torch.Tensor
    count: torch.Tensor
    chain: torch.Tensor
    chosen: torch.Tensor
    bias: torch.Tensor


def verify_layer(
    target: torch.Tensor,
    proposal: torch.Tensor,
    valid_rows: torch.Tensor | None,
    drafts: torch.Tensor,
    draft_prob: torch.Tensor,
    draft_exists: torch.Tensor,
    parent_valid: torch.Tensor,
    width: torch.Tensor,
    active: torch.Tensor,
    distinct: bool,
    source: Source,
    epsilon: float = 0.0,
) -> LayerVerdict:
    """Run the acceptance chain of one layer.

    target: [B, N] P_l over (parents x V); proposal: [B, N] the full draft table Q_l the drafts
    were drawn from; valid_rows: [B, N] bool, candidates whose parent is a valid target beam
    (None: every parent is valid); drafts: [B, m] flat candidate index of each draft;
    draft_prob: [B, m] its exact draw probability (conditional on the earlier drafts in
    distinct mode); draft_exists / parent_valid: [B, m] bool; width: [B] K, the acceptances
    needed; active: [B] sessions that verify this layer. Uniforms are drawn before the loop so
    K cannot depend on them.
    epsilon: over-acceptance ε >= 0 (module doc); 0 = exact.

    Cost: the tables are N = parents x vocabulary wide (hundreds of thousands of entries for a
    real model), so the loop touches them only where the chain really changes: an acceptance
    resets it to P (distinct: P without the chosen candidates, kept up to date in place), a
    rejection moves it to the residual; drafts no session can use cost nothing N-wide.
    """
    batch, m = drafts.shape
    # Q~: mass of rejected parents dropped, not renormalised. Distinct mode zeroes the drafted
    # candidates in place (q^(j) = norm(Q~ without d_1..d_{j-1}), below), hence the copy.
    restricted = proposal * valid_rows if valid_rows is not None else proposal
    if distinct and restricted is proposal:
        restricted = proposal.clone()
    chain = target
    target_left = target  # distinct: P without the chosen candidates (a copy once one is chosen)
    device = target.device
    count = torch.zeros(batch, dtype=torch.long, device=device)
    accepted = torch.zeros(batch, m, dtype=torch.bool, device=device)
    chosen = torch.zeros_like(target, dtype=torch.bool)
    drafted_mass = torch.zeros(batch, dtype=target.dtype, device=device)
    uniforms = uniform(source, (batch, m), target.dtype, device)
    bias = torch.zeros(batch, dtype=target.dtype, device=device)
    bonus = epsilon * (target > 0).to(target.dtype) if epsilon > 0 else None
    # on the host, drafts that can change nothing are skipped; a device computes them (they
    # change nothing there either) rather than wait to learn which they are (host_reads.py)
    skip = may_read(count)
    for j in range(m):
        d = drafts[:, j : j + 1]
        live = active & draft_exists[:, j] & (count < width)
        was_drafted = draft_exists[:, j]
        if skip and not bool((active & (count < width)).any()):
            break  # every verifying session has its K acceptances: nothing left to decide
        if skip and not bool(live.any()) and (not distinct or not bool(was_drafted.any())):
            continue  # nothing of this draft reaches a chain or a later proposal
        step_proposal = None  # q^(j), built only where needed (a rejection, or epsilon)
        numerator = chain.gather(1, d)[:, 0]
        if bonus is not None:
            step_proposal = _step_proposal(restricted, drafted_mass, distinct)
            numerator = numerator + bonus.gather(1, d)[:, 0]
            beta = torch.minimum(bonus, (step_proposal - chain).clamp_min(0.0)).sum(dim=1)
            bias = bias + torch.where(live, beta, torch.zeros_like(beta))
        ratio = numerator / draft_prob[:, j].clamp_min(1e-300)
        ok = live & parent_valid[:, j] & (uniforms[:, j] < ratio)
        rejected = live & ~ok
        accepted[:, j] = ok
        count = count + ok.long()
        after_reject = None
        if not skip or bool(rejected.any()):
            if step_proposal is None:
                step_proposal = _step_proposal(restricted, drafted_mass, distinct)
            after_reject = residual(chain, step_proposal)
        reset = target
        if distinct:
            if not skip or bool(ok.any()):
                chosen.scatter_(1, d, chosen.gather(1, d) | ok[:, None])
                if target_left is target:
                    target_left = target.clone()
                left = target_left.gather(1, d)
                target_left.scatter_(1, d, torch.where(ok[:, None], 0.0, left))
                reset = normalise(target_left)
            drafted_mass = drafted_mass + torch.where(
                was_drafted, proposal.gather(1, d)[:, 0], torch.zeros_like(drafted_mass)
            )
            # q^(j+1) excludes d_j: zero it where it was drafted (its mass left via drafted_mass)
            kept = restricted.gather(1, d)
            restricted.scatter_(1, d, torch.where(was_drafted[:, None], 0.0, kept))
        chain = _next_chain(chain, ok, reset, rejected, after_reject)
    return LayerVerdict(accepted=accepted, count=count, chain=chain, chosen=chosen, bias=bias)


def _step_proposal(
    restricted: torch.Tensor, drafted_mass: torch.Tensor, distinct: bool
) -> torch.Tensor:
    """The proposal of the current draft: Q~, and in distinct mode Q~ without the earlier
    drafts (zeroed in `restricted` already), renormalised by the mass they took."""
    if not distinct:
        return restricted
    return restricted / (1.0 - drafted_mass).clamp_min(1e-300)[:, None]


def _next_chain(
    chain: torch.Tensor,
    ok: torch.Tensor,
    reset: torch.Tensor,
    rejected: torch.Tensor,
    after_reject: torch.Tensor | None,
) -> torch.Tensor:
    """P (or P without the chosen) where the draft was accepted, the residual where it was
    rejected, the chain unchanged elsewhere; whole rows are taken as they are when every row
    went the same way (one session: always; on the host only, `host_reads`)."""
    read = may_read(ok)
    if read and after_reject is not None and bool(rejected.all()):
        return after_reject
    if read and bool(ok.all()):
        return reset
    if after_reject is not None:
        chain = torch.where(rejected[:, None], after_reject, chain)
    if not read or bool(ok.any()):
        chain = torch.where(ok[:, None], reset, chain)
    return chain


def fill_failed_layer(
    verdict: LayerVerdict,
    drafts: torch.Tensor,
    target: torch.Tensor,
    slots: int,
    remaining: torch.Tensor,
    distinct: bool,
    source: Source,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output slots of a layer that got fewer than K acceptances (ALGORITHM.md §4.3, fail branch).

    Slots 0..n-1 are the accepted drafts (draw order), slot n is one draw from the chain state
    (the lemma's fallback), later slots are fresh draws from P (distinct: without replacement,
    excluding everything already chosen). Returns (index [B, slots], exists [B, slots]) with
    exists False past each session's remaining width.
    """
    batch, m = drafts.shape
    n = verdict.count
    rank = torch.arange(m, device=drafts.device).expand(batch, m)
    order = torch.where(verdict.accepted, rank, rank + m).argsort(dim=1, stable=True)
    accepted_first = drafts.gather(1, order)
    if m < slots:
        accepted_first = torch.cat([accepted_first, drafts.new_zeros(batch, slots - m)], dim=1)
    accepted_first = accepted_first[:, :slots]
    fallback, fallback_exists = draw_one(verdict.chain, source)
    if distinct:
        taken = verdict.chosen.scatter(1, fallback[:, None], fallback_exists[:, None])
        target = target * ~taken
    fresh, fresh_exists = _draw(target, slots, distinct, source)
    k = torch.arange(slots, device=drafts.device).expand(batch, slots)
    shift = (k - n[:, None] - 1).clamp(min=0)
    fresh = fresh.gather(1, shift)
    fresh_exists = fresh_exists.gather(1, shift)
    before, at = k < n[:, None], k == n[:, None]
    index = torch.where(before, accepted_first, torch.where(at, fallback[:, None], fresh))
    exists = torch.where(before, True, torch.where(at, fallback_exists[:, None], fresh_exists))
    return index, exists & (k < remaining[:, None])


def draw_slots(
    target: torch.Tensor,
    slots: int,
    remaining: torch.Tensor,
    distinct: bool,
    source: Source,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`slots` beams from P (beam sampling step / DSBD bonus layer): (index, exists)."""
    index, exists = _draw(target, slots, distinct, source)
    k = torch.arange(slots, device=target.device).expand(target.shape[0], slots)
    return index, exists & (k < remaining[:, None])


def _draw(
    weights: torch.Tensor, slots: int, distinct: bool, source: Source
) -> tuple[torch.Tensor, torch.Tensor]:
    """`slots` draws per row, distinct (sequential without replacement) or i.i.d."""
    if distinct:
        index, _, exists = draw_distinct(weights, slots, source)
        return index, exists
    return draw_with_replacement(weights, slots, source)
