"""Dynamic width (ALGORITHM.md §5): the acceptance-count distribution and the threshold rule.

Both are pure functions batched over sessions. The recursion applies the residual step ONCE per
draft (ALGORITHM.md §5.3: the reference code's double step does not match simulation).
"""

from __future__ import annotations

import torch

from dsbd_core.algorithm.draws.distributions import residual


def acceptance_alphas(target: torch.Tensor, proposal: torch.Tensor, drafts: int) -> torch.Tensor:
    """alpha_i = sum_x min(c_{i-1}(x), proposal(x)) with c_0 = target, c_i = residual chain.

    target: [B, N] distribution P_l; proposal: [B, N] the draft table restricted to valid
    parents (sub-stochastic allowed). Returns [B, drafts].
    """
    chain = target
    alphas = []
    for _ in range(drafts):
        alphas.append(torch.minimum(chain, proposal).sum(dim=-1).clamp(0.0, 1.0))
        chain = residual(chain, proposal)
    return torch.stack(alphas, dim=-1)


def acceptance_count_distribution(alphas: torch.Tensor) -> torch.Tensor:
    """Pr[N_m = k] for every m <= M and k <= m, from alpha_1..alpha_M (ALGORITHM.md §5.1).

    After an acceptance the chain restarts from P, so with f_i = alpha_i prod_{j<i}(1-alpha_j):
    Pr[N_m = 0] = prod_{j<=m}(1-alpha_j), Pr[N_m = k] = sum_i f_i Pr[N_{m-i} = k-1].
    Returns [B, M+1, M+1] indexed [b, m, k].
    """
    batch, m_max = alphas.shape
    reject = torch.cumprod(1.0 - alphas, dim=-1)  # prod_{j<=i}(1-alpha_j)
    before = torch.cat([torch.ones_like(reject[:, :1]), reject[:, :-1]], dim=-1)
    first_accept = alphas * before  # f_i, i = 1..M
    table = alphas.new_zeros(batch, m_max + 1, m_max + 1)
    table[:, 0, 0] = 1.0
    for m in range(1, m_max + 1):
        table[:, m, 0] = reject[:, m - 1]
        # sum over i = 1..m of f_i * table[m - i, k - 1]
        f = first_accept[:, :m]  # [B, m] for i = 1..m
        previous = table[:, :m, :].flip(1)  # rows m-1, m-2, ..., 0
        table[:, m, 1:] = torch.einsum("bi,bik->bk", f, previous[:, :, :-1])
    return table


def threshold_width(
    count_distribution: torch.Tensor,
    threshold: float,
    w_min: int | torch.Tensor,
    w_max: torch.Tensor,
) -> torch.Tensor:
    """W_L = min(max(K, w_min), w_max) with K = max{k : Pr[N >= k] >= t} (ALGORITHM.md §5.2).

    count_distribution: [B, m+1] = Pr[N_m = k]; w_max: [B] the remaining width of each session.
    """
    tails = count_distribution.flip(-1).cumsum(-1).flip(-1)  # Pr[N >= k]
    k = torch.arange(tails.shape[-1], device=tails.device)
    meets = tails >= threshold - 1e-12
    largest = torch.where(meets, k, torch.zeros_like(k)).amax(dim=-1)
    w_min_t = torch.as_tensor(w_min, device=tails.device)
    return torch.minimum(torch.maximum(largest, w_min_t), w_max)


def layer_width(
    target: torch.Tensor,
    proposal: torch.Tensor,
    drafts: torch.Tensor,
    slots: int,
    threshold: float,
    w_min: int,
    w_max: torch.Tensor,
) -> torch.Tensor:
    """Width of one verified layer per session, from P_l, the valid-row proposal and the number
    of drafts each session has in the layer (`drafts`: [B] long, at most `slots`, the layer's
    draft slots: a bound known without reading the counts). The DP's rows for fewer drafts do
    not depend on how many it runs, so the bound changes no width."""
    m_max = slots
    if m_max == 0:
        return torch.minimum(torch.full_like(w_max, w_min), w_max)
    table = acceptance_count_distribution(acceptance_alphas(target, proposal, m_max))
    rows = table[torch.arange(table.shape[0], device=table.device), drafts.clamp(max=m_max)]
    return threshold_width(rows, threshold, w_min, w_max)
