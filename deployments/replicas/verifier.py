"""The verifier deployment: one target forward verifies the forests of concurrent requests.

`verify` runs `IterationCall.verify_steps` (dsbd_core: the exact layer-by-layer verification and the
per-layer width rule) for every call of a batch; the target scores all of their forests in ONE
forward (continuous batching at iteration granularity: whoever is at this step joins). The
forest arrives as an object-store reference resolved here; what goes back is the outcome only.
"""

from __future__ import annotations

import uuid
from typing import Any

from deployments.messages import DraftReply, IterationCall, VerifyReply
from deployments.observability.metrics import IterationSample
from deployments.observability.tracing import VERIFIER
from deployments.replicas.model_replica import ModelReplica
from dsbd_core.algorithm.drivers.replay import verify_job
from dsbd_core.algorithm.drivers.session_batch import Job
from dsbd_core.algorithm.scorer import ForestLayer
from dsbd_core.algorithm.sequences.prompt_logprobs import PromptLogprobs, prompt_logprob_steps
from dsbd_core.algorithm.sequences.state import NO_FOREST, Outcome


class Verifier(ModelReplica):
    """Holds the target model (tensor-parallel: a group of rank actors, model_replica.py)."""

    SERVICE, SPAN = VERIFIER, "dsbd.verify"

    async def verify(
        self, session: str, call: IterationCall, draft: DraftReply | None
    ) -> VerifyReply:
        """Verify one request's forest (`draft=None`: a plain beam-sampling step)."""
        return await self.submit(session, (call, draft))

    async def prompt_logprobs(self, prompt_ids: list[int], top: int) -> PromptLogprobs:
        """The prompt's own tokens' log-probabilities (`echo` with `logprobs`): one target
        forward of its own, whose cache is dropped at once."""
        key = f"prompt-{uuid.uuid4().hex}"
        try:
            (value,), _ = await self.run_jobs([Job(key, prompt_logprob_steps(prompt_ids, top))])
        finally:
            await self.release(key)
        if isinstance(value, BaseException):
            raise value
        return value

    async def run_batch(
        self, items: list[tuple[str, tuple[IterationCall, DraftReply | None]]]
    ) -> list[Any]:
        jobs = []
        for session, (call, draft) in items:
            forest = draft.forest if draft is not None else NO_FOREST
            jobs.append(verify_job(session, call, forest, self.vocab_size))
        with self.trace_batch([(session, call) for session, (call, _) in items]) as spans:
            results, report = await self.run_jobs(jobs)
            spans.finish(report, results, _describe)
        return [
            VerifyReply(
                value, report, draft.report if draft is not None else None, _skeleton(call, draft)
            )
            if isinstance(value, Outcome)
            else value
            for value, (_, (call, draft)) in zip(results, items, strict=True)
        ]


def _skeleton(call: IterationCall, draft: DraftReply | None) -> list[ForestLayer] | None:
    """The forest's parents and tokens, which a seeded decode's router keeps (replay.py)."""
    if call.replay is None:
        return None
    return list(draft.forest.layers) if draft is not None else []


def _describe(outcome: Outcome) -> dict[str, Any]:
    """A verify span's attributes: the verified outcome (accepted layers, widths, tokens)."""
    return IterationSample.from_outcome(outcome).attributes()
