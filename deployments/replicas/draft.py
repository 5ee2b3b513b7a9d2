"""The draft deployment: proposes each request's forest; its layer steps batched across requests.

`propose` runs `IterationCall.propose_steps` (dsbd_core: the same draft beam sampling as
in-process) for every call of a batch, in lockstep: one draft forward per forest layer for all
of them. It
returns a `DraftReply` the router never opens; it hands the reference on to the verifier.
"""

from __future__ import annotations

from typing import Any

from deployments.messages import DraftReply, IterationCall
from deployments.observability.tracing import DRAFT, forest_attributes
from deployments.replicas.model_replica import ModelReplica
from dsbd_core.algorithm.drivers.replay import draft_job
from dsbd_core.algorithm.sequences.state import Forest


class Draft(ModelReplica):
    """Holds the draft model; one replica per accelerator in production."""

    SERVICE, SPAN = DRAFT, "dsbd.draft"
    CHEAP_VARIANT = True

    async def propose(self, session: str, call: IterationCall) -> DraftReply:
        """The forest of one request's iteration (drafted together with concurrent ones)."""
        return await self.submit(session, call)

    async def run_batch(self, items: list[tuple[str, IterationCall]]) -> list[Any]:
        jobs = [draft_job(session, call, self.vocab_size) for session, call in items]
        with self.trace_batch(items) as spans:
            results, report = await self.run_jobs(jobs)
            spans.finish(report, results, forest_attributes)
        return [
            DraftReply(value, report) if isinstance(value, Forest) else value for value in results
        ]
