"""The engine's iteration as separate steps, the way the serving layer distributes it.

`propose` runs on the draft's side, `verify` on the target's, and only pickled messages cross
between them: the forest goes draft -> verifier, the small outcome verifier -> caller. For the
same seed this must decode exactly what `run` decodes in one process, and the caller's messages
never contain the forest.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from dsbd_core import SamplingConfig, TableScorer, generate_batch
from dsbd_core.algorithm.engine import Engine
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.scorer import drive
from dsbd_core.algorithm.sequences.state import Forest, Outcome
from tests.support.exact_reference import random_table


def scorers(seed: int) -> tuple[TableScorer, TableScorer]:
    rng = np.random.default_rng(seed)
    target = TableScorer(torch.from_numpy(random_table(rng, 7, 3, concentration=0.6)))
    draft = TableScorer(torch.from_numpy(random_table(rng, 7, 3, concentration=0.6)))
    return target, draft


@pytest.mark.parametrize(
    "extra",
    [{"threshold": 0.6}, {"threshold": None, "mode": "with_replacement"}, {"lean_memory": True}],
)
def test_split_steps_with_serialised_messages_equal_run(extra: dict) -> None:
    config = SamplingConfig(width=3, gamma=3, max_new_tokens=9, eos_token_ids=(0,), seed=4, **extra)
    prompts = [[1, 2], [3, 4, 5], [6, 1]]
    fresh_target, fresh_draft = scorers(0)
    expected = generate_batch("dsbd", fresh_target, prompts, config, fresh_draft)

    target, draft = scorers(0)
    vocab = target.vocab_size
    run = method_config("dsbd", config)
    caller = Engine(run, vocab)  # holds the state (the router)
    draft_side = Engine(run, vocab)  # only ever calls propose
    target_side = Engine(run, vocab)  # only ever calls verify
    state = caller.start(prompts)
    while caller.next_iteration(state):
        proposed = drive(draft, draft_side.propose_steps(pickle.loads(pickle.dumps(state))))
        forest = pickle.loads(pickle.dumps(proposed))
        assert isinstance(forest, Forest)
        verified = drive(
            target, target_side.verify_steps(pickle.loads(pickle.dumps(state)), forest)
        )
        message = pickle.dumps(verified)
        outcome = pickle.loads(message)
        assert isinstance(outcome, Outcome)
        assert b"Forest" not in message and not hasattr(outcome, "layers")
        caller.advance(state, outcome)
    got = caller.finish(state)
    for a, b in zip(got, expected, strict=True):
        assert [x.token_ids for x in a.beams] == [x.token_ids for x in b.beams]
        assert a.stats.as_dict() == b.stats.as_dict()
