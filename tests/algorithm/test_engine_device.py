"""The engine keeps every tensor of an iteration on its state's device (`Engine.start(device=)`),
so that on a GPU the vocabulary-wide work runs beside the models and no log-prob row crosses to
the host.

CPU-side evidence (no GPU here): decode with torch's default device set to `meta` while the
state lives on the CPU. A tensor the engine made without naming a device lands on `meta`, where
mixing it with the state's tensors or reading its value fails, exactly where it would land on
the host beside a CUDA state. The scorers' own calls run with the CPU default again (the model
side is not under test here); the tokens must be those of the plain decode.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsbd_core import SamplingConfig, generate_batch
from dsbd_core.models.draft_variants import restrict_head
from dsbd_core.models.static_scorer import StaticScorer
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.meta_device import PROMPTS, same_decodes
from tests.support.tiny_models import tiny

CASES = [
    ("sample", {}),
    ("sps", {"gamma": 3}),
    ("beam", {"width": 3}),
    ("dsbd", {"width": 3, "gamma": 3, "threshold": None, "logprobs": 2}),
    ("dsbd", {"width": 3, "gamma": 2, "threshold": 0.7, "draft_width": 4}),
    ("dsbd", {"width": 3, "gamma": 2, "threshold": 0.7, "mode": "with_replacement"}),
    ("dsbd", {"width": 3, "gamma": 3, "threshold": 0.7, "lean_memory": True}),
    ("dsbd", {"width": 2, "gamma": 2, "epsilon": 0.1}),
    ("beam_search", {"width": 3, "logprobs": 1}),
    ("spec_beam_search", {"width": 3, "gamma": 3}),
]


@pytest.mark.slow
@pytest.mark.parametrize("scorer", [TransformerScorer, StaticScorer])
@pytest.mark.parametrize(("method", "fields"), CASES)
def test_the_engine_makes_no_tensor_off_its_state_device(
    method: str, fields: dict, scorer: type[TransformerScorer]
) -> None:
    same_decodes(method, fields, scorer, tiny("llama", 2).float())


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [None, 0.7])
def test_a_restricted_draft_head_keeps_its_tables_on_the_state_device(
    threshold: float | None,
) -> None:
    """A draft that scores K tokens only sends K-wide tables and its support (`Forest`)."""
    draft = tiny("llama", 2).float()
    restrict_head(draft, torch.tensor([0, 2, 3, 5, 7, 11, 13]))
    fields = {"width": 3, "gamma": 2, "threshold": threshold}
    same_decodes("dsbd", fields, StaticScorer, draft)


def test_an_in_process_decode_keeps_its_state_beside_the_model() -> None:
    """`generate` puts the state on the target scorer's `engine_device` (its model's device)."""
    from dsbd_core.algorithm.drivers.loop import engine_device

    model = tiny("llama", 1)
    assert engine_device(TransformerScorer(model)) == model.device
    assert engine_device(StaticScorer(model)) == model.device
    assert engine_device(object()) == torch.device("cpu")  # e.g. a remote verifier's stub


@pytest.mark.slow
@pytest.mark.parametrize(("method", "fields"), CASES)
def test_the_branches_a_device_takes_decode_the_hosts_tokens(method: str, fields: dict) -> None:
    """On a device the engine computes where the host reads a value to skip work
    (`host_reads`); forced on the CPU, those branches give the same tokens, scores and
    statistics for the same seeds (no draw is added or moved), in float64 and alone or
    batched."""
    from dsbd_core.algorithm.draws.host_reads import computing_everywhere

    target, draft = tiny("llama", 1), tiny("llama", 2)
    for seed in (0, 1, 2):
        config = SamplingConfig(max_new_tokens=10, eos_token_ids=(0,), seed=seed, **fields)
        plain = generate_batch(method, StaticScorer(target), PROMPTS, config, StaticScorer(draft))
        with computing_everywhere():
            forced = generate_batch(
                method, StaticScorer(target), PROMPTS, config, StaticScorer(draft)
            )
        for got, want in zip(forced, plain, strict=True):
            assert [b.token_ids for b in got.beams] == [b.token_ids for b in want.beams]
            assert [b.log_likelihood for b in got.beams] == [b.log_likelihood for b in want.beams]
            # The forced branches run the draft on rows the host skips, and on some CPUs (an
            # AMD EPYC here, not the Intel Xeon) a float64 forward's last bit depends on the
            # rows beside it: the draft's tables, and so the diagnostic alphas (sum min(P, Q)),
            # may move by an ulp. Everything else is exact; the n-gram test below, whose tables
            # come from no forward, holds the alphas to the bit as well.
            alphas = got.stats.layer_alphas, want.stats.layer_alphas
            assert [len(a) for a in alphas[0]] == [len(a) for a in alphas[1]]
            assert [x for a in alphas[0] for x in a] == pytest.approx(
                [x for a in alphas[1] for x in a], rel=1e-12, abs=0
            )
            assert replace(got.stats, layer_alphas=[]) == replace(want.stats, layer_alphas=[])


@pytest.mark.slow
@pytest.mark.parametrize(("method", "fields"), CASES)
def test_the_device_branches_match_the_host_over_many_sessions(method: str, fields: dict) -> None:
    """The same on an exact n-gram table with 300 sessions in one batch: rejections, refills,
    EOS in accepted drafts and every width rule meet both branch sets many times over."""
    from dsbd_core.algorithm.draws.host_reads import computing_everywhere
    from tests.support.table_scorers import scorers

    prompts = [[1 + i % 5, 2 + i % 3] for i in range(300)]
    config = SamplingConfig(max_new_tokens=8, eos_token_ids=(0,), seed=7, **fields)
    plain = generate_batch(method, *scorers()[:1], prompts, config, scorers()[1])
    with computing_everywhere():
        forced = generate_batch(method, *scorers()[:1], prompts, config, scorers()[1])
    assert [[b.token_ids for b in r.beams] for r in forced] == [
        [b.token_ids for b in r.beams] for r in plain
    ]
    assert [r.stats for r in forced] == [r.stats for r in plain]


def test_results_cross_to_the_host_in_one_copy_with_their_values_and_dtypes() -> None:
    """`collect_results` moves the pool, counters and per-iteration records from a device in
    one copy, through float64: token ids, flags, counts and float32 alphas come back exact."""
    from dsbd_core.algorithm.draws.host_reads import _collect, _rebuild, packed, unpacked

    tree = (
        [torch.tensor([151_935, 0, 2**40]), torch.tensor([True, False])],
        {
            "alphas": torch.tensor([[0.1234567, -1.0]], dtype=torch.float32),
            "score": torch.tensor([-3.25e-7], dtype=torch.float64),
        },
        [(torch.zeros(0, 3, dtype=torch.long),)],
    )
    tensors: list[torch.Tensor] = []
    _collect(tree, tensors)
    back = _rebuild(tree, iter(unpacked(packed(tensors), tensors)))
    again: list[torch.Tensor] = []
    _collect(back, again)
    assert len(again) == len(tensors) == 5
    for a, b in zip(again, tensors, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert isinstance(back[2][0], tuple) and isinstance(back[1], dict)
