"""The prompt-lookup draft served (issue 48): the Draft deployment hosts `NgramDraft` when its
source is 'ngram' (no weights), so the app keeps its structure: the router's decode loop, the
verifier and the calibration see a draft replica like any other. In this process, without Ray
(deployments/decode/local_handles.py): served decodes are the in-process decodes, token for
token, and
the router calibrates the pair through it, pricing the look-up at no forward cost."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from deployments.app import AppArgs
from deployments.decode.local_handles import LocalHandle as Handle
from deployments.decode.session import DecodeSession, pair_calibration
from deployments.decode.session_registry import SessionRegistry
from deployments.decode.state import Handles, RouterState
from deployments.replicas.draft import Draft
from deployments.replicas.verifier import Verifier
from dsbd.serve_command import load_config
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.drivers.decoders import generate
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.scorers.ngram_draft import NgramDraft
from dsbd_core.models import load_causal_lm
from dsbd_core.models.lookup_calibration import LOOKUP_COSTS
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.tiny_models import build_pair

PROMPT = [5, 17, 42, 5, 17, 42, 5, 17]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    target, _ = build_pair(tmp_path_factory.mktemp("models"))
    options = {"dtype": "float64", "batch_wait_s": 0.0}
    draft = Draft({"source": "ngram", "variant": {"ngram_max": 2}, **options}, str(target))
    verifier = Verifier({"source": str(target), **options})
    handles = Handles(
        draft=Handle(draft),
        verifier=Handle(verifier),
        controller=Handle(SessionRegistry(None, 60.0)),
    )
    return {"target": target, "draft": draft, "verifier": verifier, "handles": handles}


@pytest.mark.parametrize(
    ("method", "knobs"),
    [
        ("dsbd", {"width": 3, "gamma": 3, "threshold": 0.7}),
        ("sps", {"gamma": 3}),
        ("spec_beam_search", {"width": 2, "gamma": 2}),
    ],
)
def test_served_decodes_with_the_lookup_draft_are_the_in_process_ones(
    served: dict[str, Any], method: str, knobs: dict[str, Any]
) -> None:
    draft_info = asyncio.run(served["draft"].info())
    assert draft_info["memory"] is None and draft_info["costs"] == LOOKUP_COSTS.model_dump()
    vocab = int(asyncio.run(served["verifier"].info())["vocab_size"])
    config = method_config(method, SamplingConfig(max_new_tokens=10, seed=3, **knobs))
    router = RouterState(served["handles"])
    session = DecodeSession(router, vocab, config, adaptive=False)
    got = asyncio.run(session.run(PROMPT))
    target = load_causal_lm(str(served["target"]), dtype=torch.float64)
    want = generate(method, TransformerScorer(target.model), PROMPT, config, NgramDraft(vocab, 2))
    assert [b.token_ids for b in got.beams] == [b.token_ids for b in want.beams]
    assert got.stats.accepted_tokens == want.stats.accepted_tokens
    assert want.stats.drafted_tokens > 0


@pytest.mark.slow  # over a second: outside the quick loop
def test_the_router_calibrates_the_pair_through_the_lookup_replica(
    served: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSBD_CALIBRATION_DIR", str(tmp_path / "calibration"))
    calibration = asyncio.run(pair_calibration(RouterState(served["handles"])))
    assert calibration is not None and calibration.draft == LOOKUP_COSTS
    assert calibration.iteration_s and len(calibration.iteration_s) == 4
    assert "prompt lookup, n-grams up to 2" in calibration.description


def test_the_app_config_names_the_lookup_draft(tmp_path: Path) -> None:
    args = AppArgs.model_validate({"draft": {"source": "ngram", "variant": {"ngram_max": 5}}})
    assert args.draft.variant.ngram_max == 5
    for bad, named in (
        ({"draft": {"source": "ngram", "variant": {"ngram_max": 17}}}, "ngram_max"),
        ({"target": {"source": "ngram"}}, "target.source='ngram'"),
    ):
        with pytest.raises(ValidationError, match=named):
            AppArgs.model_validate(bad)
    schema = load_config(None, "127.0.0.1", 8000, draft="ngram", ngram_max=4)
    draft = AppArgs.model_validate(schema.applications[0].args).draft
    assert (draft.source, draft.variant.ngram_max) == ("ngram", 4)
    with pytest.raises(SystemExit):
        load_config(None, "127.0.0.1", 8000, draft="ngram", ngram_max=0)
