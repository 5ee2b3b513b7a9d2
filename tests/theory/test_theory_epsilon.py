"""The ε over-acceptance knob in the product (THEORY.md §5.4, §9.3 item 6).

Measured through the real verifier (`dsbd_core.algorithm.iteration.verify.verify_layer`, one beam)
and compared with the closed forms of `dsbd.theory.overaccept`: rejection `Σ (Q - P - ε)_+`,
least bias `Σ min(ε, (Q - P)_+)` and Decoding-OPT's output law (target P, draft Q). Then the engine:
ε = 0 reports no bias, ε > 0 accepts more, reports a bias bound, and the bias it really introduces
stays below that bound. (ε = 0 exactness itself is the unchanged tests/algorithm/test_exactness.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from dsbd.cli import build_parser, config_from_args
from dsbd.theory import overaccept_bias, overaccept_layer, overaccept_rejection
from dsbd.theory.overaccept import overaccept_step_law
from dsbd_core import SamplingConfig, TableScorer, config_error_message, generate_batch
from dsbd_core.algorithm.draws.distributions import draw_distinct, draw_with_replacement
from dsbd_core.algorithm.draws.streams import Draws
from dsbd_core.algorithm.iteration.verify import fill_failed_layer, verify_layer
from tests.support.exact_reference import (
    TableLM,
    assert_matches,
    multinomial_outcomes,
    null_tv_quantile,
)
from tests.support.exact_reference import tv as dict_tv

RUNS = 200_000
TARGET = np.array([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
DRAFT = np.array([0.10, 0.15, 0.35, 0.05, 0.25, 0.10])


def run_layer(target, draft, eps, drafts=1, distinct=False, seed=0):
    """One layer of `drafts` candidates, K = 1, one parent: (slot-0 token, accepted?, bias)."""
    gen = Draws.seeded(seed)
    t = torch.tensor(target, dtype=torch.float64).expand(RUNS, -1).clone()
    q = torch.tensor(draft, dtype=torch.float64).expand(RUNS, -1).clone()
    if distinct:
        index, prob, exists = draw_distinct(q, drafts, gen)
    else:
        index, exists = draw_with_replacement(q, drafts, gen)
        prob = q.gather(1, index)
    ones = torch.ones(RUNS, dtype=torch.bool)
    verdict = verify_layer(
        t,
        q,
        torch.ones_like(t, dtype=torch.bool),
        index,
        prob,
        exists,
        exists,
        torch.ones(RUNS, dtype=torch.long),
        ones,
        distinct,
        gen,
        epsilon=eps,
    )
    slots, _ = fill_failed_layer(
        verdict, index, t, 1, torch.ones(RUNS, dtype=torch.long), distinct, gen
    )
    return slots[:, 0].numpy(), (verdict.count == 1).numpy(), verdict.bias.numpy()


def within_4_se(samples: np.ndarray, expected: float) -> bool:
    se = max(samples.std(ddof=1), 1e-12) / np.sqrt(len(samples))
    return abs(samples.mean() - expected) <= 4 * se


@pytest.mark.parametrize("distinct", [False, True])
@pytest.mark.parametrize("eps", [0.05, 0.12])
def test_verify_layer_rejection_bias_and_law_equal_the_closed_forms(eps, distinct) -> None:
    token, accepted, bias = run_layer(TARGET, DRAFT, eps, distinct=distinct, seed=int(eps * 100))
    rejection = overaccept_rejection(TARGET, DRAFT, eps)
    least = overaccept_bias(TARGET, DRAFT, eps)
    assert rejection > 0.05 and least > 0.05  # both sides of the trade-off are exercised
    assert within_4_se((~accepted).astype(float), rejection)
    # the bias the verifier reports is the closed form, exactly, in every session
    assert np.abs(bias - least).max() < 1e-12
    # output law = Decoding-OPT's law; its measured TV to the target = Loss*(eps)
    opt = overaccept_step_law(TARGET, DRAFT, eps, "opt")
    assert_matches(token.tolist(), dict(enumerate(opt)), f"OPT law eps={eps}")
    over = opt > TARGET  # TV = Σ_{opt > target} (opt - target): unbiased linear estimator
    measured = np.isin(token, np.nonzero(over)[0]).astype(float) - TARGET[over].sum()
    assert within_4_se(measured, least)


def test_epsilon_never_accepts_outside_the_target_support() -> None:
    """Filtered-out candidates (P = 0) are never emitted; the closed forms hold with
    ε·[P > 0] per token."""
    target = np.array([0.5, 0.3, 0.2, 0.0, 0.0])
    draft = np.array([0.2, 0.2, 0.2, 0.2, 0.2])
    eps = 0.15
    token, accepted, bias = run_layer(target, draft, eps, seed=3)
    vector = eps * (target > 0)
    assert not np.isin(token, [3, 4]).any()
    assert within_4_se((~accepted).astype(float), overaccept_rejection(target, draft, vector))
    assert np.abs(bias - overaccept_bias(target, draft, vector)).max() < 1e-12


def test_multi_draft_layer_follows_the_epsilon_chain_and_its_bound() -> None:
    """K = 1, three i.i.d. drafts (THEORY.md §9.3 item 6): the slot law is the ε chain's, the mean
    reported bias is Σ_m (Π_{j<m} R_j) β_m, and it bounds the layer's TV bias."""
    eps = 0.08
    token, _, bias = run_layer(TARGET, DRAFT, eps, drafts=3, seed=11)
    law, _, bound = overaccept_layer(TARGET, DRAFT, 3, eps)
    assert_matches(token.tolist(), dict(enumerate(law)), "eps layer law")
    assert within_4_se(bias, bound)
    assert 0.5 * np.abs(law - TARGET).sum() <= bound


def test_epsilon_zero_reports_no_bias_and_verifies_exactly_as_before() -> None:
    token, accepted, bias = run_layer(TARGET, DRAFT, 0.0, seed=5)
    same = run_layer(TARGET, DRAFT, 0.0, seed=5)
    assert (bias == 0).all() and (token == same[0]).all() and (accepted == same[1]).all()
    assert_matches(token.tolist(), dict(enumerate(TARGET)), "eps=0 is exact")


# ----------------------------------------------------------------------------- engine
V, EOS, MAX_NEW = 4, 0, 3


def tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logp = [np.log(rng.dirichlet(np.ones(V), size=V)) for _ in range(2)]
    return logp[0], logp[1]


def decode(target, draft, runs, method="sps", **extra):
    cfg = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_ids=(EOS,), seed=1, gamma=2, **extra)
    return generate_batch(
        method,
        TableScorer(torch.from_numpy(target)),
        [[1]] * runs,
        cfg,
        TableScorer(torch.from_numpy(draft)),
    )


@pytest.mark.slow
def test_engine_epsilon_trades_exactness_for_speed_within_the_reported_bound() -> None:
    target, draft = tables(0)
    runs = 40_000
    exact_runs = decode(target, draft, runs)
    lossy = decode(target, draft, runs, epsilon=0.2)
    assert all(r.stats.epsilon_bias_bound == 0.0 for r in exact_runs)
    bounds = np.array([r.stats.epsilon_bias_bound for r in lossy])
    assert (bounds > 0).mean() > 0.5

    def rate(results, name):
        return np.mean([getattr(r.stats, name) for r in results])

    assert rate(lossy, "acceptance_rate") > rate(exact_runs, "acceptance_rate") + 0.05
    assert rate(lossy, "target_passes_per_token") < rate(exact_runs, "target_passes_per_token")
    # the bias is real (detectable) and below the reported bound's mean
    exact_law = multinomial_outcomes(TableLM(target), [1], MAX_NEW, {EOS})
    samples = [tuple(r.best.token_ids) for r in lossy]
    counts: dict = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1 / runs
    noise = null_tv_quantile(exact_law, runs, 0.999)
    measured = dict_tv(counts, exact_law)
    assert measured > noise, "eps = 0.2 should bias the output detectably"
    assert measured - noise <= bounds.mean()
    assert_matches([tuple(r.best.token_ids) for r in exact_runs], exact_law, "eps = 0 exact")


def test_engine_records_first_draft_acceptance_per_verified_layer() -> None:
    target, draft = tables(1)
    for method, extra in (("sps", {}), ("dsbd", {"width": 2, "threshold": 0.7})):
        for r in decode(target, draft, 50, method=method, **extra):
            st = r.stats
            assert [len(a) for a in st.layer_alphas] == [len(w) for w in st.widths]
            assert all(0.0 <= a <= 1.0 for layer in st.layer_alphas for a in layer)
            assert "layer_alphas" not in st.as_dict() and "epsilon_bias_bound" in st.as_dict()
    # draft == target: every layer has alpha_1 = 1
    for r in decode(target, target, 20):
        assert all(abs(a - 1.0) < 1e-12 for layer in r.stats.layer_alphas for a in layer)


# ----------------------------------------------------------------------------- config / CLI
@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_epsilon_is_validated(value: float) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingConfig(epsilon=value)
    assert config_error_message(info.value).startswith(f"epsilon={value!r}")


def test_cli_exposes_epsilon_and_says_it_trades_exactness() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--epsilon", "0.1"])
    assert config_from_args(args).epsilon == 0.1
    assert SamplingConfig().epsilon == 0.0
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    assert "trades exactness for speed" in " ".join(generate.format_help().split())


def test_http_api_models_carry_epsilon_from_the_config() -> None:
    from deployments.api.models import DecodingKnobs

    field = DecodingKnobs.model_fields["epsilon"]
    assert field.default == 0.0 and "trades exactness for speed" in field.description
