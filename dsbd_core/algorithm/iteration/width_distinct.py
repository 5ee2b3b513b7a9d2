"""Dynamic width for distinct drafts: Pr[N >= k] of the without-replacement rule, by simulation.

The width DP of ALGORITHM.md §5.1 (`dsbd_core.algorithm.iteration.width`) is exact for i.i.d.
drafts. In `distinct` mode (the default) the drafts are drawn without replacement and verified with
the
conditional rule of ALGORITHM.md §4.5, and there the DP is only an approximation (§4.5 says so;
decision 9 of the same page). It is a good one when the layer's mass is spread over many
candidates, and a bad one when it is concentrated: the i.i.d. chain may accept the one likely token
again and again, the distinct rule needs as many *different* accepted candidates as the width. On a
layer with one input beam and a 0.9-probability next token (lean mode, code) the DP puts Pr[N >= 3]
at 0.86 where the distinct rule achieves 0.60, so `threshold = 0.7` asked for width 3 and the layer
failed 40% of the time instead of at most 30% (measured on the Qwen pair: lean layers passed 0.49
of the time at t = 0.7; tests/algorithm/test_width_distinct.py reproduces the gap).

So for distinct drafts the count distribution is estimated by running the real rule: `samples`
simulated layers per session, drafts drawn by `draw_distinct` and verified by `verify_layer` (the
very code a layer is verified with), on a small version of the layer: the `keep` candidates with the
most target or draft mass, kept exactly, and the others pooled by the ratio log(P / Q~) in a few
groups (plus target-only, draft-only and rejected-parent groups), each group's masses spread evenly
over `spread` stand-in candidates. That preserves every total and the first draft's acceptance `Σ
min(P, Q~)` exactly, and the tails Pr[N >= k] of the full layer within 0.015 on the layers of
tests/algorithm/test_width_distinct.py (peaky, flat, several parents with a rejected one). Cost:
`samples` x (`keep` + 16 x `spread`) numbers per session and draft.

Exactness is untouched: the width of a layer must not depend on its drafts or its uniforms
(ALGORITHM.md §4.4), and this estimate depends only on (P_l, Q_l, the valid parents) and a random
stream of its own per layer and iteration (`streams.WIDTH`).
"""

from __future__ import annotations

import functools

import torch

from dsbd_core.algorithm.draws.distributions import Source, draw_distinct
from dsbd_core.algorithm.draws.host_reads import may_read
from dsbd_core.algorithm.draws.streams import Draws
from dsbd_core.algorithm.iteration.verify import verify_layer
from dsbd_core.algorithm.iteration.width import layer_width, threshold_width

SAMPLES = 256  # simulated layers per session: standard error <= 0.031 on each Pr[N >= k]
KEEP = 64  # candidates kept exactly (by max(P, Q))
SPREAD = 8  # stand-in candidates per group of the remaining mass
CHUNK = 1 << 24  # simulated numbers per chunk (samples x candidates x rows): 128 MiB in float64


# Edges of the log(P / Q~) groups the rest of the layer is binned into (open at both ends). The
# edge at 0 keeps every group on one side of P = Q, where min(sum P, sum Q) = sum min(P, Q): the
# first draft's acceptance is then kept exactly.
RATIO_EDGES = (-3.0, -2.0, -1.5, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0)


_FAR = 1000.0  # log-ratio standing for P / Q~ = inf (target only) and 0 (draft only)
_QUARTERS = int(4 * _FAR)


@functools.cache
def _ratio_groups(device: torch.device) -> torch.Tensor:
    """Group of every quarter step of log(P / Q~): index ceil(4 log(P / Q~)) + 4000 -> bin.

    Every edge of RATIO_EDGES is a multiple of 1/4, so the quarter step (f - 1) / 4 < l <= f / 4
    decides the bin exactly; a table lookup replaces a binary search per candidate (bucketize
    costs 9 ms on a 4 x 152k layer, the lookup under 2). Bins: 0..E the candidates with both
    masses (as bucketize(l, RATIO_EDGES)), E+1 target only, E+2 draft only.
    """
    steps = torch.arange(-_QUARTERS, _QUARTERS + 1, dtype=torch.float64, device="cpu")
    middle = (steps - 0.5) / 4  # a point inside each quarter step
    edges = torch.tensor(RATIO_EDGES, dtype=torch.float64, device="cpu")
    groups = torch.bucketize(middle, edges)
    groups[0] = len(RATIO_EDGES) + 2  # l = -inf: P = 0, draft only
    groups[-1] = len(RATIO_EDGES) + 1  # l = +inf: Q~ = 0, target only
    return groups.to(device)


def _group(rest_p: torch.Tensor, rest_q: torch.Tensor) -> torch.Tensor:
    """The bin of every candidate (see `_ratio_groups`); 0 / 0 (no mass) lands anywhere."""
    quarters = torch.div(rest_p, rest_q).log_()
    quarters.nan_to_num_(nan=-_FAR, posinf=_FAR, neginf=-_FAR).mul_(4).ceil_()
    index = quarters.clamp_(-_QUARTERS, _QUARTERS).to(torch.long).add_(_QUARTERS)
    return _ratio_groups(index.device)[index]


def small_layer(
    target: torch.Tensor,
    table: torch.Tensor,
    valid_rows: torch.Tensor | None,
    keep: int,
    spread: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(P', Q', valid') on `keep` candidates plus stand-ins that play the rest of the layer.

    target: [B, N] P_l; table: [B, N] the full draft table Q_l the drafts come from; valid_rows:
    [B, N] candidates whose parent is a valid target beam (None: all); Q~ = Q * valid. The
    `keep` candidates with the most mass (max(P, Q)) are kept as they are. The others are
    grouped by how the two models weigh them, the ratio log(P / Q~) in the bins of
    `RATIO_EDGES`, plus target-only, draft-only and rejected-parent groups, and each group's two
    masses are spread evenly over `spread` stand-ins: a stand-in keeps its group's ratio, so
    what a tail draft's acceptance and the residual after it look like is kept too (a split
    into "shared" and one-model-only parts keeps the first acceptance but lets no later draft
    reach the target's own tail mass, and underrated Pr[N >= 3] by 0.1 on a peaky layer).
    """
    batch, size = target.shape
    all_valid = valid_rows is None
    if valid_rows is None:
        valid_rows = torch.ones(1, 1, dtype=torch.bool, device=target.device).expand(batch, size)
    if size <= keep:  # the whole layer fits: nothing to stand in for
        return target, table, valid_rows
    restricted = table if all_valid else table * valid_rows
    index = torch.maximum(target, table).topk(keep, dim=-1).indices
    rest_p = target.scatter(1, index, 0.0)
    rest_q = restricted.scatter(1, index, 0.0)
    groups = len(RATIO_EDGES) + 1
    group = _group(rest_p, rest_q)
    mass_p = target.new_zeros(batch, groups + 3).scatter_add_(1, group, rest_p)
    mass_q = target.new_zeros(batch, groups + 3).scatter_add_(1, group, rest_q)
    if not all_valid:  # draft mass on rejected parents
        mass_q[:, groups + 2] = (table - restricted).scatter(1, index, 0.0).sum(dim=-1)
    stand_in_p = (mass_p / spread).repeat_interleave(spread, dim=-1)
    stand_in_q = (mass_q / spread).repeat_interleave(spread, dim=-1)
    stand_in_valid = torch.ones_like(stand_in_p, dtype=torch.bool)
    stand_in_valid[:, (groups + 2) * spread :] = False
    return (
        torch.cat([target.gather(1, index), stand_in_p], dim=-1),
        torch.cat([table.gather(1, index), stand_in_q], dim=-1),
        torch.cat([valid_rows.gather(1, index), stand_in_valid], dim=-1),
    )


def distinct_count_tails(
    target: torch.Tensor,
    table: torch.Tensor,
    valid_rows: torch.Tensor | None,
    drafts: torch.Tensor,
    slots: int,
    source: Draws,
    *,
    samples: int = SAMPLES,
    keep: int = KEEP,
    spread: int = SPREAD,
) -> torch.Tensor:
    """Estimated Pr[N >= k], k = 0..slots, per session ([B, slots + 1]).

    `drafts`: [B] drafts each session has in the layer (its draft width W_S; 0: not verified),
    at most `slots` (the layer's draft slots, known without reading the counts). N counts
    acceptances without a cap, as the DP does. Every session is simulated with numbers of its
    own (its simulated layers are its rows of the stream, `Draws.rows_from`), in chunks of at
    most `CHUNK` numbers: what a session draws depends neither on what the others need nor on
    the chunks, so a device (which simulates every session rather than wait to learn which
    need it) and the host estimate the same widths.
    """
    batch = target.shape[0]
    m = slots
    if m == 0:
        tails = torch.zeros(batch, 1, dtype=target.dtype, device=target.device)
        return tails.fill_(1.0)
    p, q, valid = small_layer(target, table, valid_rows, keep, spread)
    rows = max(1, CHUNK // (samples * p.shape[1]))
    return torch.cat(
        [
            _simulated_tails(
                p[i : i + rows],
                q[i : i + rows],
                valid[i : i + rows],
                drafts[i : i + rows],
                m,
                samples,
                source.rows_from(i * samples),
            )
            for i in range(0, batch, rows)
        ]
    )


def _simulated_tails(
    p: torch.Tensor,
    q: torch.Tensor,
    valid: torch.Tensor,
    drafts: torch.Tensor,
    m: int,
    samples: int,
    source: Source,
) -> torch.Tensor:
    """Pr[N >= k] from `samples` layers per row, drafted and verified by the real rule."""
    batch = p.shape[0]
    p, q, valid = (x.repeat_interleave(samples, dim=0) for x in (p, q, valid))
    index, prob, exists = draw_distinct(q, m, source)
    device = p.device
    exists &= torch.arange(m, device=device) < drafts.repeat_interleave(samples)[:, None]
    verdict = verify_layer(
        p,
        q,
        valid,
        index,
        prob,
        exists,
        exists & valid.gather(1, index),
        torch.full((batch * samples,), m, device=device),
        torch.ones(batch * samples, dtype=torch.bool, device=device),
        True,
        source,
    )
    count = verdict.count.reshape(batch, samples)
    tails = torch.ones(batch, m + 1, dtype=p.dtype, device=device)
    for k in range(1, m + 1):
        tails[:, k] = (count >= k).to(p.dtype).mean(dim=1)
    return tails


def distinct_layer_width(
    target: torch.Tensor,
    table: torch.Tensor,
    valid_rows: torch.Tensor | None,
    drafts: torch.Tensor,
    slots: int,
    threshold: float,
    w_min: int,
    w_max: torch.Tensor,
    source: Draws,
) -> torch.Tensor:
    """Width of one verified layer per session for distinct drafts (the threshold rule of
    ALGORITHM.md §5.2 on the estimated count distribution).

    Where the estimate cannot change the width, the DP's exact answer is kept: a session with
    at most one draft (one draft: both rules accept it w.p. sum min(P, Q~)) or whose width is
    forced (`w_max <= w_min`). The estimate is needed only where K >= 2 is possible. The host
    computes only the rule some session needs (the estimate's numbers are the layer's own
    stream, `streams.WIDTH`: skipping it moves no later draw); a device computes both and
    selects.
    """
    needs = (drafts >= 2) & (w_max > w_min)
    host = may_read(needs)

    def exact() -> torch.Tensor:
        restricted = table if valid_rows is None else table * valid_rows
        return layer_width(target, restricted, drafts, slots, threshold, w_min, w_max)

    if host and not bool(needs.any()):
        return exact()
    tails = distinct_count_tails(target, table, valid_rows, drafts, slots, source)
    point = tails - torch.cat([tails[:, 1:], torch.zeros_like(tails[:, :1])], dim=1)
    estimated = threshold_width(point, threshold, w_min, w_max)
    if host and bool(needs.all()):
        return estimated
    return torch.where(needs, estimated, exact())
