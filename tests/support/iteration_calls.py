"""The calls the router sends a replica, built by the real engine (no Serve, no router)."""

from __future__ import annotations

from deployments.messages import IterationCall
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.engine import Engine
from dsbd_core.algorithm.methods import method_config


def first_call(vocab: int, prompt: list[int]) -> IterationCall:
    """The router's first iteration of a DSBD request (what `DecodeSession` sends the draft)."""
    config = method_config(
        "dsbd", SamplingConfig(width=2, gamma=2, max_new_tokens=8, seed=0, eos_token_ids=(0,))
    )
    engine = Engine(config, vocab)
    state = engine.start([prompt])
    assert engine.next_iteration(state)
    return IterationCall(state.for_models(), config)
