"""The cost model's priors: the pair's pass rates measured at calibration, where it has them.

A controller that starts from fixed, hopeful priors drafts on hope at the start of every request
(the embedded pair's draft is accepted a quarter of the time: DSBD was 0.77x beam sampling);
one that starts from the pair's measured rates drafts only where the measurement says it pays.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsbd_core import SamplingConfig, TableScorer
from dsbd_core.algorithm.drivers.decoders import generate
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.policy.cost_model import (
    Calibration,
    CostController,
    CostPolicy,
    ForwardCosts,
)
from dsbd_core.algorithm.policy.iteration_timer import IterationTimer
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from dsbd_core.models.calibrate import calibrate, measure_iteration_seconds, measure_pass_rates
from dsbd_core.models.lookup_calibration import LOOKUP_COSTS
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.tiny_models import tiny

# a draft call costs a fifth of a target call, the target's cost grows slowly with its tokens
COSTS = {
    "target": ForwardCosts(tokens=[1, 16], seconds=[0.010, 0.012]),
    "draft": ForwardCosts(tokens=[1, 16], seconds=[0.002, 0.0024]),
}


def _calibration(pass_rates: list[float] | None) -> Calibration:
    return Calibration(**COSTS, pass_rates=pass_rates)


def test_a_pair_measured_to_rarely_agree_is_not_drafted_at_the_start() -> None:
    config = SamplingConfig()  # W = 3, gamma = 3, fixed width
    assert CostController(config, _calibration([0.1, 0.2])).knobs(None).gamma == 0  # type: ignore[arg-type]
    agreeing = CostController(config, _calibration([0.9, 0.95]))
    assert agreeing.knobs(None).gamma == 3  # type: ignore[arg-type]
    assert agreeing.priors() == [0.9, 0.95, 0.95]  # the deepest measured stands for deeper
    rare = CostController(config, _calibration([0.1, 0.2]))
    assert rare.probe_interval == rare.policy.probe_every * rare.policy.probe_backoff
    assert agreeing.probe_interval == agreeing.policy.probe_every
    hopeful = CostController(config, _calibration(None))  # not measured: the policy's priors
    assert hopeful.priors() == [0.6, 0.8, 0.8]
    assert hopeful.knobs(None).gamma > 0  # type: ignore[arg-type]
    # one drafted beam (SpS) starts from the rates measured with one, where measured
    both = Calibration(**COSTS, pass_rates=[0.5, 0.6], single_pass_rates=[0.9, 0.8])
    sps = method_config("sps", config)
    assert CostController(sps, both).priors() == [0.9, 0.8, 0.8]
    assert CostController(config, both).priors() == [0.5, 0.6, 0.6]
    assert CostController(sps, _calibration([0.5])).priors() == [0.5, 0.5, 0.5]


@pytest.mark.slow
def test_pass_rates_are_high_for_a_draft_equal_to_the_target_and_lower_for_another() -> None:
    target = tiny("llama", 1)
    prompts = [[1, 2, 3], [4, 5]]
    # no stop token: a layer whose accepted beams all ended has no children to pass with
    same = measure_pass_rates(
        TransformerScorer(target), TransformerScorer(tiny("llama", 1)), prompts, ()
    )
    other = measure_pass_rates(
        TransformerScorer(target), TransformerScorer(tiny("llama", 7)), prompts, ()
    )
    assert same and all(rate == pytest.approx(1.0) for rate in same)
    assert other[0] < 0.9


@pytest.mark.slow
def test_calibration_measures_the_pass_rates_once_and_caches_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSBD_CALIBRATION_DIR", str(tmp_path))
    target, draft = tiny("llama", 1).float(), tiny("llama", 7).float()
    identity = {"target": "t", "draft": "d", "description": "tiny pair"}
    said: list[str] = []
    first = calibrate(
        target, draft, identity, 16, say=said.append, prompts=[[1, 2, 3]], stop_ids=(0,)
    )
    assert first.pass_rates and all(0.0 <= r <= 1.0 for r in first.pass_rates)
    assert any("pass rates" in line for line in said)
    cached = sorted(p.name.split("-")[0] + "-" + p.name.split("-")[1] for p in tmp_path.iterdir())
    assert "pass-rates" in cached and "iteration-seconds" in cached
    assert first.iteration_s and len(first.iteration_s) == 4 and first.catch_up_s is not None
    assert first.single_pass_rates and all(0.0 <= r <= 1.0 for r in first.single_pass_rates)
    again = calibrate(
        target, draft, identity, 16, say=said.append, prompts=[[1, 2, 3]], stop_ids=(0,)
    )
    assert again.pass_rates == first.pass_rates
    assert again.iteration_s == first.iteration_s and again.catch_up_s == first.catch_up_s
    assert torch.equal(torch.tensor(again.pass_rates), torch.tensor(first.pass_rates))


def _timed(catch_up_s: float | None) -> Calibration:
    """A pair whose measured iterations cost 10 ms at depth 0 and 15 ms per drafted layer
    more (twice what its forwards' sum says), its draft agreeing half the time."""
    return Calibration(
        **COSTS, pass_rates=[0.5], iteration_s=[0.010, 0.025, 0.040, 0.055], catch_up_s=catch_up_s
    )


def test_whole_iterations_timed_at_calibration_are_the_prices_at_their_widths() -> None:
    config = SamplingConfig(max_new_tokens=64)
    timed = CostController(config, _timed(None))
    parts = CostController(config, _calibration([0.5]))
    for gamma, seconds in enumerate([0.010, 0.025, 0.040, 0.055]):
        assert timed.iteration_seconds(gamma) == pytest.approx(seconds)
    # the parts' sum says drafting pays at these pass rates; the timed iterations say not
    assert parts.best_gamma() > 0
    assert timed.best_gamma() == 0
    # another width: the parts' sum at that width, scaled as at the timed widths
    wide = CostController(SamplingConfig(width=5, draft_width=2), _timed(None))
    assert wide.iteration_seconds(1) == pytest.approx(
        wide.parts_seconds(1, 5, 2) * 0.025 / wide.parts_seconds(1, 3, 3)
    )


def test_a_drafted_iteration_is_never_priced_below_a_beam_step() -> None:
    """The look-up's calibration on an AMD EPYC without AVX-512 (the embedded pair in float32,
    the measured figures): its iterations were timed with mostly empty layers (the calibration's
    prompts rarely repeat), so scaling the full forest's parts by them priced a drafted SpS
    iteration below a plain step, and SpS drafted every iteration at 0.055 passes. Floored at a
    beam step plus the target's forward over the forest, drafting does not pay at that rate."""
    lookup = Calibration(
        target=ForwardCosts(
            tokens=[1, 4, 8, 16, 32, 48],
            seconds=[0.0544, 0.0870, 0.1439, 0.1986, 0.2095, 0.2896],
        ),
        draft=LOOKUP_COSTS,
        engine_step_s=0.00259,
        engine_layer_s=0.00324,
        engine_width=3,
        pass_rates=[0.0],
        single_pass_rates=[0.055, 0.8, 0.25],
        iteration_s=[0.1247, 0.1273, 0.1326, 0.1340],
        catch_up_s=0.0001,
    )
    sps = CostController(method_config("sps", SamplingConfig(max_new_tokens=48)), lookup)
    target = lookup.target
    for gamma in (1, 2, 3):
        scaled = sps.parts_seconds(gamma, 1, 1) * sps.scale(gamma)
        assert scaled < sps.iteration_seconds(0)  # what the scaled parts alone said
        floor = sps.iteration_seconds(0) + target.at(1 + gamma) - target.at(1)
        assert sps.iteration_seconds(gamma) == pytest.approx(floor)
    assert sps.best_gamma() == 0
    assert sps.knobs(None).gamma == 0  # type: ignore[arg-type]
    # where the timed iterations cost more than the floor, they stand (the timed pair above)
    timed = CostController(SamplingConfig(max_new_tokens=64), _timed(None))
    assert timed.iteration_seconds(1) == pytest.approx(0.025)


def _controller(catch_up_s: float, since_draft: int) -> CostController:
    """A request that drafted, found its draft not paying, and has sat it out since."""
    cheap = Calibration(**COSTS, pass_rates=[0.9], catch_up_s=catch_up_s)
    controller = CostController(SamplingConfig(max_new_tokens=512), cheap)
    controller.drafted, controller.since_draft = True, since_draft
    for rate in controller.rates:  # the request's own evidence: its draft never agrees
        rate.add(0.0, 1000.0, 1.0)
    controller.probe_interval = 1  # a probe is due
    return controller


def test_a_probe_is_made_only_while_the_drafts_catch_up_is_cheap() -> None:
    """A probe first catches the draft up on every beam step it sat out: once that costs more
    than `probe_budget` of the time since it last ran, a draft that stopped paying is left."""
    steps = 24
    assert _controller(0.0, steps).knobs(None).gamma == 1  # type: ignore[arg-type]
    assert _controller(0.001, steps).knobs(None).gamma == 0  # type: ignore[arg-type]


def test_the_catch_up_is_paid_only_where_enough_tokens_are_left_to_win_it_back() -> None:
    """A draft that agrees but sat out 100 steps is worth catching up with 500 tokens to go,
    not with 4."""
    cal = Calibration(**COSTS, pass_rates=[0.9], catch_up_s=0.001)
    controller = CostController(SamplingConfig(max_new_tokens=512), cal)
    controller.drafted, controller.since_draft = True, 100
    assert controller.best_gamma() > 0  # no state: the whole budget is left
    nearly_done = CostController(SamplingConfig(max_new_tokens=4), cal)
    nearly_done.drafted, nearly_done.since_draft = True, 100
    assert nearly_done.best_gamma() == 0


@pytest.mark.slow  # over a second: outside the quick loop
def test_whole_iterations_and_a_probe_are_timed_through_the_decode_loop() -> None:
    target, draft = tiny("llama", 1), tiny("llama", 7)
    timed = measure_iteration_seconds(
        TransformerScorer(target), TransformerScorer(draft), [[1, 2, 3], [4, 5]], ()
    )
    seconds = timed["iteration_s"]
    assert len(seconds) == 4 and all(s > 0 for s in seconds)  # depths 0..3 (gamma = 3)
    assert timed["catch_up_s"] is not None and timed["catch_up_s"] >= 0


def test_an_iteration_timer_runs_its_schedule_and_knows_how_far_the_draft_is_behind() -> None:
    config = SamplingConfig(max_new_tokens=12, seed=0)
    timer = IterationTimer(config, [1, 0, 0, 0, 2, 0])
    generate(
        "dsbd",
        TransformerScorer(tiny("llama", 1)),
        [1, 2, 3],
        config,
        draft=TransformerScorer(tiny("llama", 7)),
        controller=timer,
    )
    records = timer.records()
    assert [(g, behind) for g, _, behind in records[:6]] == [
        (1, None),
        (0, None),
        (0, None),
        (0, None),
        (2, 3),
        (0, None),
    ]
    assert all(g == 0 for g, _, _ in records[6:])  # the last depth repeats
    with pytest.raises(ValueError, match="schedule"):
        IterationTimer(config, [4])


def _hopeful_decode(
    seed: int,
    policy: CostPolicy,
    catch_up_s: float = 0.0005,
    controller_class: type[CostController] = CostController,
) -> CostController:
    """A 48-token request on a tiny pair whose draft rarely agrees, under a calibration that
    promises it agrees 95 % of the time and that a drafted layer costs half a beam step."""
    cal = Calibration(
        **COSTS, pass_rates=[0.95], iteration_s=[0.010, 0.015, 0.020, 0.025], catch_up_s=catch_up_s
    )
    config = SamplingConfig(max_new_tokens=48, seed=seed)
    controller = controller_class(config, cal, policy)
    generate(
        "dsbd",
        TransformerScorer(tiny("llama", 1)),
        [1, 2, 3],
        config,
        draft=TransformerScorer(tiny("llama", 7)),
        controller=controller,
    )
    return controller


def _decode_with_budget(loss_budget: float, seed: int) -> CostController:
    """`_hopeful_decode` with no bets beyond the budget (`bet_ratio` out of reach)."""
    return _hopeful_decode(seed, CostPolicy(loss_budget=loss_budget, memory=1.0, bet_ratio=1e9))


@pytest.mark.slow  # over a second: outside the quick loop
def test_a_request_loses_at_most_its_budget_to_a_draft_that_does_not_agree() -> None:
    """Hopeful priors keep drafting while the request's own evidence piles up; the loss budget
    stops it once the worst case of another drafted iteration would pass 2 % of a beam decode."""
    for seed in range(3):
        bounded = _decode_with_budget(0.02, seed)
        assert any(gamma > 0 for gamma in bounded.chosen)
        assert bounded.loss <= bounded.loss_budget_seconds() + 1e-12
        unbounded = _decode_with_budget(1.0, seed)  # the same request without the bound
        assert unbounded.loss > bounded.loss_budget_seconds()


def test_a_draft_whose_prompt_costs_more_than_the_budget_is_not_run() -> None:
    cal = Calibration(**COSTS, pass_rates=[0.9], catch_up_s=0.01)
    controller = CostController(SamplingConfig(max_new_tokens=64), cal)
    state = SimpleNamespace(prompt_len=torch.tensor([300]))  # 100 beam steps' worth to feed
    assert not controller.affordable(1, controller.catch_up_seconds(state))  # type: ignore[arg-type]
    assert controller.knobs(state).gamma == 0  # type: ignore[arg-type]
    short = CostController(SamplingConfig(max_new_tokens=64), cal)
    assert short.knobs(SimpleNamespace(prompt_len=torch.tensor([3]))).gamma > 0  # type: ignore[arg-type]


def test_beyond_the_budget_a_draft_is_run_only_on_a_bet_worth_its_risk() -> None:
    """A prompt whose catch-up alone passes the loss budget: drafted when what drafting is
    expected to save over the request is at least bet_ratio times what it risks."""
    cal = Calibration(**COSTS, pass_rates=[0.9], catch_up_s=0.01)
    state = SimpleNamespace(prompt_len=torch.tensor([30]))  # 10 beam steps' worth to feed
    config = SamplingConfig(max_new_tokens=256)
    betting = CostController(config, cal)
    assert not betting.affordable(1, betting.catch_up_seconds(state))  # type: ignore[arg-type]
    assert betting.knobs(state).gamma > 0  # type: ignore[arg-type]
    wary = CostController(config, cal, CostPolicy(bet_ratio=100.0))
    assert wary.knobs(state).gamma == 0  # type: ignore[arg-type]


def _counting_table(vocab: int, period: int) -> torch.Tensor:
    """A bigram target that counts: v -> (v + 1) mod `period` with probability 0.99."""
    logp = torch.full((vocab, vocab), math.log(0.01 / (vocab - 1)), dtype=torch.float64)
    for v in range(vocab):
        logp[v, (v + 1) % period] = math.log(0.99)
    return logp


@pytest.mark.parametrize("period", [4, 64])
@pytest.mark.parametrize(("method", "knobs"), [("dsbd", {"threshold": 0.7}), ("sps", {})])
def test_the_ngram_draft_is_drafted_where_the_text_repeats_and_not_where_it_does_not(
    method: str, knobs: dict, period: int
) -> None:
    """The prompt-lookup draft priced like any draft (zero forward cost, the policy's priors):
    a request whose text repeats (period 4) keeps drafting and its layers pass; one whose text
    does not repeat (64 tokens counted from 0) finds empty layers and ends decoding as beam
    sampling does. (Fixed width W = 3 needs three distinct accepted drafts a layer, which a
    look-up whose every match is followed by one token cannot give: dynamic width can.)"""
    calibration = Calibration(target=COSTS["target"], draft=LOOKUP_COSTS)
    config = method_config(method, SamplingConfig(max_new_tokens=48, seed=0, **knobs))
    controller = CostController(config, calibration)
    result = generate(
        method,
        TableScorer(_counting_table(64, period)),
        [0],
        config,
        draft=NgramDraft(64),
        controller=controller,
    )
    drafted = sum(gamma > 0 for gamma in controller.chosen[-12:])
    if period == 4:
        assert drafted == 12 and result.stats.target_passes_per_token < 0.5
    else:
        assert drafted == 0 and result.stats.accepted_tokens == 0


class _BoundChecked(CostController):
    """A controller that checks, after every drafted iteration, the bound its rule promises:
    the request's loss (in the calibration's prices) at most the larger of its budget and
    1 / bet_ratio of what the depth chosen was expected to save."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.bounds: dict[int, float] = {}  # set before the constructor asks `affordable`
        self.pending = 0.0
        self.checked: list[tuple[float, float]] = []  # (loss after, bound) per drafted iteration
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def affordable(self, gamma: int, lag: float, saving: float = 0.0) -> bool:
        granted = super().affordable(gamma, lag, saving)
        if granted:
            bet = saving / self.policy.bet_ratio
            self.bounds[gamma] = max(self.loss_budget_seconds(), bet)
        return granted

    def knobs(self, state):  # type: ignore[no-untyped-def]
        self.bounds = {}
        knobs = super().knobs(state)
        self.pending = self.bounds.get(knobs.gamma, 0.0)
        return knobs

    def observe(self, state, outcome, knobs) -> None:  # type: ignore[no-untyped-def]
        super().observe(state, outcome, knobs)
        if knobs.gamma > 0:
            self.checked.append((self.loss, self.pending))


@pytest.mark.parametrize("catch_up_s", [0.0005, 0.004])
def test_the_default_rule_loses_at_most_its_budget_or_half_of_what_it_bet_on(
    catch_up_s: float,
) -> None:
    """The default policy (bet_ratio 2) on a draft that rarely agrees under a calibration that
    promises it agrees 95 % of the time: after every drafted iteration the request's loss is at
    most max(loss_budget x a beam decode, what the chosen depth was expected to save / 2), the
    bound cost_model.py and docs/SERVING.md state. The default rule's bets reach past the budget,
    so the budget alone is not the bound."""
    past_budget = False
    for seed in range(3):
        controller = _hopeful_decode(seed, CostPolicy(), catch_up_s, _BoundChecked)
        assert isinstance(controller, _BoundChecked)
        assert controller.checked, "nothing was drafted: the bound was not exercised"
        for loss, bound in controller.checked:
            assert loss <= bound + 1e-12, (loss, bound)
        budget = controller.loss_budget_seconds()
        print(
            f"catch-up {catch_up_s}: loss {controller.loss / budget:.2f} budgets, bounds up to "
            f"{max(b for _, b in controller.checked) / budget:.2f}"
        )
        past_budget |= any(b > controller.loss_budget_seconds() for _, b in controller.checked)
    assert past_budget  # the default rule bets beyond the budget: the budget alone is no bound
