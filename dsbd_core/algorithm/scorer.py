"""The contract between the decoding engine and a model: score a forest, keep its caches.

The engine (dsbd_core/algorithm/engine.py) works on a batch of `B` independent sessions (one
prompt's beams each), each holding up to `R` beams. A model is reached only through a
`ForestScorer`, so the same engine runs on an exact n-gram table (tests, theory), on a
transformers causal LM with KV caches (`TransformerScorer`), and on a remote, tensor-parallel
verifier.

Per iteration the engine calls, for each model:

1. `set_roots(roots)`: the beams the iteration starts from (the forest's roots). `origin`
   says where each new root came from in the previous iteration's forest, so a cached model
   can compact its KV cache to the accepted paths (ALGORITHM.md §6.4) instead of re-prefilling. A
   scorer that cannot reuse a cache may always rebuild from `tokens`.
2. `forward(layers)`, once or several times: feeds the roots' uncached tokens (first call after
   `set_roots` only) and the given new forest layers in ONE model forward, and returns
   next-token log-probabilities for the roots (first call only) and for every node of the given
   layers. The draft calls `forward([])` then `forward([layer_l])` per draft layer; the target calls
   `forward([layer_1, ..., layer_gamma])` once: one target forward per iteration.

Layer `l` nodes are children of layer `l-1` nodes; layer 0 are the root rows.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import torch


@dataclass
class ForestLayer:
    """One layer of draft nodes for every session of the batch.

    parent: [B, M] long — index of each node's parent in the previous layer (layer 0: root row).
    token:  [B, M] long — the node's token.
    exists: [B, M] bool — False marks padding; a padding node's outputs are never read and its
            `parent`/`token` are arbitrary valid indices.
    """

    parent: torch.Tensor
    token: torch.Tensor
    exists: torch.Tensor


@dataclass
class Origin:
    """Where each new root row comes from in the previous iteration's forest.

    root: [B, R] long — the old root row the new beam descends from.
    path: [B, R, D] long — node index at forest layers 1..D along the new beam's path; -1 past
          the layer the beam branched off (`D` may be 0: plain beam sampling).
    The new beam's tokens = old root tokens ++ tokens of the path nodes ++ one new token. Rows
    with `alive` False are padding.
    """

    root: torch.Tensor
    path: torch.Tensor


@dataclass
class ForestLogprobs:
    """Next-token log-probabilities (raw model distribution, log-softmax of the logits).

    roots:  [B, R, V] at the end of every root beam, or None if the roots were already fed.
    layers: one [B, M_l, V] tensor per layer passed to `forward`, at each node.
    support: None, or [K] long: the distributions are compact, over these K token ids only
            (the last dimension is K, not V), every other token has probability 0. A draft
            whose head scores only its K most frequent tokens answers so: its tables, draws and
            the forest it sends are K wide instead of V wide (`draft_forest.py`).
    Entries of dead rows / padding nodes are unspecified (finite) and never read.
    """

    roots: torch.Tensor | None
    layers: list[torch.Tensor]
    support: torch.Tensor | None = None


@dataclass
class Roots:
    """The beams an iteration starts from: the forest's roots (`ForestScorer.set_roots`).

    tokens:  [B, R, L] long — full token sequences (prompt + generated), right-padded.
    lengths: [B] long — sequence length of session b (all beams of a session are equally long).
    alive:   [B, R] bool — real beams; other rows are padding and must cost nothing.
    origin:  None at the first iteration of a session batch (prefill), else see `Origin`.
    host:    the same roots on the host, where the engine lives on a device and copied them
             with its planning values (one wait instead of one per scorer); None elsewhere.
             A scorer that plans on the host uses them; outputs go where `tokens` lives.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    alive: torch.Tensor
    origin: Origin | None
    host: Roots | None = None


@runtime_checkable
class ForestScorer(Protocol):
    """A model as the engine sees it."""

    @property
    def vocab_size(self) -> int:
        """Size of the distributions returned (the logits' last dimension)."""
        ...

    def set_roots(self, roots: Roots) -> None:
        """Start an iteration from these beams (see `Roots`)."""
        ...

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        """One model forward over the uncached root tokens (first call) and the new layers."""
        ...

    def release(self) -> None:
        """Drop every cache (end of the decode call)."""
        ...


@dataclass
class ScoreCall:
    """One model step a decode asks for: new roots (first step of an iteration), then a forward.

    The engine's iterations are written as generators that yield `ScoreCall`s and receive the
    `ForestLogprobs`. In-process, `drive` answers them from one scorer; a serving replica answers
    the calls of many concurrent requests with ONE batched forward
    (dsbd_core/algorithm/drivers/session_batch.py)
    without a second implementation of the algorithm.
    """

    roots: Roots | None
    layers: list[ForestLayer]


T = TypeVar("T")


def returning(value: T) -> Generator[ScoreCall, ForestLogprobs, T]:
    """A side that calls no model: a generator that returns `value` at once."""
    return value
    yield  # a generator function, never reached


def drive(scorer: ForestScorer, steps: Generator[ScoreCall, ForestLogprobs, T]) -> T:
    """Run a decode step generator to its end against one scorer; returns its value."""
    try:
        call = next(steps)
        while True:
            if call.roots is not None:
                scorer.set_roots(call.roots)
            call = steps.send(scorer.forward(call.layers))
    except StopIteration as stop:
        return stop.value
