"""What crosses between the deployments each iteration (all small except the forest).

router -> draft      `IterationCall` (dsbd_core.algorithm.loop: state for the models + this
                     iteration's config + the router's trace context)
draft -> verifier    `DraftReply` (the forest), as an object-store reference the router only
                     forwards: the router passes the draft's `DeploymentResponse` into the
                     verifier call and never awaits it
verifier -> router   `VerifyReply` (the next beams and their `Origin`: accepted-beam indices)
router -> draft      the next `IterationCall` carries that `Origin`, which is how the accepted
                     paths reach the draft for its cache compaction
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsbd_core.algorithm.loop import IterationCall
from dsbd_core.algorithm.session_batch import BatchReport
from dsbd_core.algorithm.state import Forest, Outcome

__all__ = ["DraftReply", "IterationCall", "SideReport", "VerifyReply"]


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
