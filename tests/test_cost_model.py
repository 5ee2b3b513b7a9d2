"""The cost model's priors: the pair's pass rates measured at calibration, where it has them.

A controller that starts from fixed, hopeful priors drafts on hope at the start of every request
(the embedded pair's draft is accepted a quarter of the time: DSBD was 0.77x beam sampling);
one that starts from the pair's measured rates drafts only where the measurement says it pays.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsbd_core import SamplingConfig
from dsbd_core.algorithm.cost_model import Calibration, CostController, ForwardCosts
from dsbd_core.models.calibrate import calibrate, measure_pass_rates
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.test_engine_transformers import tiny

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
    assert "pass-rates" in cached
    again = calibrate(
        target, draft, identity, 16, say=said.append, prompts=[[1, 2, 3]], stop_ids=(0,)
    )
    assert again.pass_rates == first.pass_rates
    assert torch.equal(torch.tensor(again.pass_rates), torch.tensor(first.pass_rates))
