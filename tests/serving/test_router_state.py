"""A router replica's calibration (deployments/decode/calibration.py, kept on its `RouterState`)
with the serving path's real classes in this process, without Ray
(deployments/decode/local_handles.py):
the pair's pass rates and whole-iteration timings it measures through the draft and verifier
replicas, once per machine, and the priors it gives the cost model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from deployments.decode.local_handles import LocalHandle as Handle
from deployments.decode.session import pair_calibration
from deployments.decode.session_registry import SessionRegistry
from deployments.decode.state import Handles, RouterState
from deployments.replicas.draft import Draft
from deployments.replicas.verifier import Verifier
from dsbd_core.algorithm.drivers.decoders import generate
from dsbd_core.algorithm.policy.cost_model import CostController, CostPolicy
from dsbd_core.models import load_causal_lm
from dsbd_core.models.calibrate import PassCounter, pass_rate_config
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.tiny_models import build_pair


@pytest.mark.slow  # over a second: outside the quick loop
def test_a_router_measures_the_pairs_pass_rates_once_per_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first calibration decodes the pass-rate prompts through the replicas and gets the
    rates the in-process measurement gets (float64: the same draws); a second router on the
    machine reads them from the cache without a call; the cost model starts from them."""
    monkeypatch.setenv("DSBD_CALIBRATION_DIR", str(tmp_path / "calibration"))
    target, draft = build_pair(tmp_path / "models")
    options = {"dtype": "float64", "batch_wait_s": 0.0}
    draft_replica = Draft({"source": str(draft), **options})
    verifier = Verifier({"source": str(target), **options})
    controller = SessionRegistry(None, 60.0)
    handles = Handles(
        draft=Handle(draft_replica), verifier=Handle(verifier), controller=Handle(controller)
    )

    first = asyncio.run(pair_calibration(RouterState(handles)))
    assert first is not None and first.pass_rates, first
    # whole served iterations timed at each depth 0..gamma, and the draft's catch-up
    assert first.iteration_s and len(first.iteration_s) == 4, first
    assert first.catch_up_s is not None and first.catch_up_s >= 0
    assert asyncio.run(controller.load())["open_sessions"] == 0  # its decodes closed

    inputs = asyncio.run(verifier.info())["pass_rate_inputs"]
    config = pass_rate_config(tuple(inputs["stop_ids"]))
    counter = PassCounter(config)
    target_lm = load_causal_lm(str(target), dtype=torch.float64)
    draft_lm = load_causal_lm(str(draft), dtype=torch.float64)
    for prompt in inputs["prompts"]:
        generate(
            "dsbd",
            TransformerScorer(target_lm.model),
            prompt,
            config,
            draft=TransformerScorer(draft_lm.model),
            controller=counter,
        )
    assert first.pass_rates == counter.rates()

    calls = verifier.calls_run
    second = asyncio.run(pair_calibration(RouterState(handles)))
    assert second is not None and second.pass_rates == first.pass_rates
    assert second.iteration_s == first.iteration_s and second.catch_up_s == first.catch_up_s
    assert verifier.calls_run == calls, "the second router decoded instead of reading the cache"

    measured = first.pass_rates
    priors = CostController(config, second, CostPolicy()).priors()
    assert priors == [measured[min(k, len(measured) - 1)] for k in range(config.gamma)]


@pytest.mark.slow  # over a second: outside the quick loop
def test_a_failed_calibration_shows_in_the_status_and_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calibration's decodes fail (a replica lost meanwhile): the router keeps what was
    measured (the forward costs), says why in its status, and the next adaptive request after
    CALIBRATION_RETRY_S measures the pair again, clearing the error."""
    from deployments.decode import calibration as served_calibration
    from deployments.decode import state as router_state
    from deployments.decode.router import Router

    monkeypatch.setenv("DSBD_CALIBRATION_DIR", str(tmp_path / "calibration"))
    monkeypatch.setattr(router_state, "CALIBRATION_RETRY_S", 0.0)
    target, draft = build_pair(tmp_path / "models")
    options = {"dtype": "float64", "batch_wait_s": 0.0}
    router = Router(
        Handle(Draft({"source": str(draft), **options})),
        Handle(Verifier({"source": str(target), **options})),
        Handle(SessionRegistry(None, 60.0)),
    )

    async def lost(*_: object) -> None:
        raise RuntimeError("the draft replica died (a test's stand-in)")

    async def scenario() -> tuple[dict, object, dict, object]:
        failed = await served_calibration.pair_calibration(router.state, lost)
        during = (await router.info())["calibration"]
        retried = await pair_calibration(router.state)
        return during, failed, (await router.info())["calibration"], retried

    during, failed, after, retried = asyncio.run(scenario())
    assert during["state"] == "failed" and "the draft replica died" in during["error"]
    assert failed is not None and failed.pass_rates is None  # the costs stand, rates unset
    assert after == {"state": "measured", "error": None, "retry_in_s": None}
    assert retried is not None and retried.pass_rates
