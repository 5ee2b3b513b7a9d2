"""Golden values of the acceptance-count DP and the width rule (ALGORITHM.md §5.5, §12.2
items 8-9)."""

import torch

from dsbd_core.algorithm.iteration.width import (
    acceptance_alphas,
    acceptance_count_distribution,
    layer_width,
    threshold_width,
)

P = torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05]], dtype=torch.float64)
Q = torch.tensor([[0.1, 0.3, 0.1, 0.3, 0.2]], dtype=torch.float64)


def close(actual: torch.Tensor, expected: list[float]) -> None:
    assert torch.allclose(actual, torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=0)


def test_alphas_and_count_distributions_match_golden_values() -> None:
    alphas = acceptance_alphas(P, Q, 4)
    close(alphas[0], [0.6, 0.2, 0.2, 0.2])
    table = acceptance_count_distribution(alphas)[0]
    close(table[2, :3], [0.32, 0.32, 0.36])
    close(table[3, :4], [0.256, 0.288, 0.24, 0.216])
    close(table[4], [0.2048, 0.256, 0.2368, 0.1728, 0.1296])
    tails = table[4].flip(0).cumsum(0).flip(0)
    close(tails, [1.0, 0.7952, 0.5392, 0.3024, 0.1296])
    mean = (torch.arange(5) * table[4]).sum()
    assert abs(float(mean) - 1.7664) < 1e-9
    assert torch.allclose(table.sum(dim=1), torch.ones(5, dtype=torch.float64))
    # Every draft accepted: each one meets the freshly reset chain, so Pr[N_m = m] = alpha_1^m
    for m in range(1, 5):
        assert abs(float(table[m, m] - alphas[0, 0] ** m)) < 1e-12


def test_sub_stochastic_proposal_golden_values() -> None:
    target = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=torch.float64)
    restricted = torch.tensor([[0.2, 0.2, 0.2, 0.0]], dtype=torch.float64)  # 4th row rejected
    alphas = acceptance_alphas(target, restricted, 3)
    close(alphas[0], [0.6, 0.4, 0.2833333333333333])
    close(acceptance_count_distribution(alphas)[0, 3], [0.172, 0.276, 0.336, 0.216])


def test_threshold_widths_match_golden_values() -> None:
    row = acceptance_count_distribution(acceptance_alphas(P, Q, 4))[:, 4]
    w_max = torch.tensor([4])
    got = {t: int(threshold_width(row, t, 0, w_max)) for t in (0.9, 0.7, 0.5, 0.3, 0.1)}
    assert got == {0.9: 0, 0.7: 1, 0.5: 2, 0.3: 3, 0.1: 4}


def test_width_rule_is_monotone_and_clamped() -> None:
    gen = torch.Generator().manual_seed(0)
    target = torch.rand(64, 12, generator=gen, dtype=torch.float64)
    target /= target.sum(-1, keepdim=True)
    proposal = torch.rand(64, 12, generator=gen, dtype=torch.float64)
    proposal /= proposal.sum(-1, keepdim=True)
    drafts = torch.randint(1, 7, (64,), generator=gen)
    w_max = torch.randint(2, 7, (64,), generator=gen)
    previous = None
    for t in torch.linspace(0.0, 1.0, 21).tolist():
        width = layer_width(target, proposal, drafts, 6, t, 2, w_max)
        assert bool(((width >= torch.minimum(torch.tensor(2), w_max)) & (width <= w_max)).all())
        if previous is not None:
            assert bool((width <= previous).all()), "width must not grow with the threshold"
        previous = width


def test_draft_equal_to_target_has_no_nan_and_full_width() -> None:
    alphas = acceptance_alphas(P, P, 4)
    close(alphas[0], [1.0, 1.0, 1.0, 1.0])
    table = acceptance_count_distribution(alphas)
    assert not torch.isnan(table).any()
    assert int(threshold_width(table[:, 4], 0.99, 1, torch.tensor([4]))) == 4
