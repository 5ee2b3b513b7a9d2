"""What crosses between the deployments each iteration (all small except the forest).

router -> draft      `IterationCall` (dsbd_core.algorithm.drivers.loop: state for the models + this
                     iteration's config + the router's trace context)
draft -> verifier    `DraftReply` (the forest), as an object-store reference the router only
                     forwards: the router passes the draft's `DeploymentResponse` into the
                     verifier call and never awaits it
verifier -> router   `VerifyReply` (the next beams and their `Origin`: accepted-beam indices;
                     for a seeded decode also the forest's parents and tokens, which the
                     router keeps to rebuild a lost cache: dsbd_core/algorithm/drivers/replay.py)
router -> draft      the next `IterationCall` carries that `Origin`, which is how the accepted
                     paths reach the draft for its cache compaction

Once per request, between the HTTP ingress and the router that runs its decode loop:

ingress -> router    `DecodeCall` (prompt ids, config, method, the request span's context)
router -> ingress    `Committed` per iteration that commits tokens (streams), then `DecodeEnd`
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsbd_core.algorithm.drivers.loop import IterationCall
from dsbd_core.algorithm.drivers.session_batch import BatchReport
from dsbd_core.algorithm.methods import MethodConfig
from dsbd_core.algorithm.scorer import ForestLayer
from dsbd_core.algorithm.sequences.result import DecodeResult
from dsbd_core.algorithm.sequences.state import Forest, Outcome
from dsbd_core.algorithm.sequences.stops import StopStrings

__all__ = [
    "Committed",
    "DecodeCall",
    "DecodeEnd",
    "DraftReply",
    "IterationCall",
    "SideReport",
    "VerifyReply",
]


@dataclass
class SideReport:
    """How the batch that served one request's side of an iteration looked."""

    batch: BatchReport
    replica: str  # the replica's id (affinity and re-prefill show up here)
    seconds: float  # the batch's compute time


@dataclass
class DraftReply:
    """The draft's forest for one request."""

    forest: Forest
    report: SideReport


@dataclass
class VerifyReply:
    """The verified outcome (no forest) with both sides' reports, for the request's stats."""

    outcome: Outcome
    report: SideReport
    draft: SideReport | None = field(default=None)
    # the forest the target scored (parents, tokens), for calls that carry `replay`
    layers: list[ForestLayer] | None = None


@dataclass
class DecodeCall:
    """One request's decode, as the ingress hands it to a router replica. Self-contained, so
    the ingress can hand the same call to another replica when the first one dies."""

    prompt_ids: list[int]
    config: MethodConfig  # the request's method decides whether a draft runs
    adaptive: bool
    vocab_size: int
    trace: dict[str, str] = field(default_factory=dict)  # the request span (W3C carrier)
    # stop strings with the tokenizer they are matched through (by name: a few bytes)
    stop: StopStrings | None = None


@dataclass
class Committed:
    """Tokens the decode newly committed (final: every candidate starts with them), with
    their log-probs when the request tracks them: what a stream may send."""

    ids: list[int]
    chosen: list[float] | None = None  # log-prob of each token
    tops: list[list[tuple[int, float]]] | None = None  # the most likely tokens at each


@dataclass
class DecodeEnd:
    """The decode's result, its serving statistics and the totals for the request span."""

    result: DecodeResult
    session: str
    serving: dict[str, Any]
    totals: dict[str, int]


class TensorParallelBroken(RuntimeError):
    """A tensor-parallel verifier's group lost a rank (or a rank failed); the replica must be
    replaced. Defined here, beside the other things that cross to the router, so that the
    router can recognise it without importing the model code that raises it."""
