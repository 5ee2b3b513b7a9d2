"""The co-located layout: one replica owns the target, the draft and the decode loop.

Why: on one GPU the draft and the verifier are best in one process, as vLLM and SGLang run them.
The split layout (a Router, a Draft and a Verifier deployment) pays per iteration two Serve calls
and an object-store trip of the forest (a few ms each on a CPU: `dsbd bench`'s served iteration
cost), which a captured GPU iteration of a few ms cannot afford. Here the decode loop is the
router's own (`Router`: the same `DecodeSession`, cost model, calibration and streaming), and
it drives the two model replicas of this process through local handles
(deployments/decode/local_handles.py): an iteration is two awaited method calls in one event
loop, the forest never serialised. Concurrent requests still batch: each model replica keeps its
continuous batcher, so the loops of all requests here meet in one draft forward per layer and one
target forward per iteration.

What a loss costs: the replica holds both the loop and the caches, so a dead pair replica costs
its requests a hand-over by the ingress to another replica (deployments/decode/client.py): the
decode starts over there, seeded, and a stream skips what it already sent; no request is lost.
The ingress reads the two models' info and the prompt log-probs through the pair
(`draft_info`, `verifier_info`, `verifier_prompt_logprobs`: `local_handles.SideHandle`).
"""

from __future__ import annotations

from typing import Any

from deployments.decode.local_handles import LocalHandle
from deployments.decode.router import Router
from deployments.replicas.draft import Draft
from deployments.replicas.model_options import ModelOptions
from deployments.replicas.verifier import Verifier
from dsbd_core.algorithm.sequences.prompt_logprobs import PromptLogprobs


class Pair(Router):
    """The target, the draft and the decode loops of one replica (see the module docstring)."""

    LAYOUT = "colocated"  # its served iterations (the calibration's) cost no Serve calls

    def __init__(self, target: dict[str, Any], draft: dict[str, Any], controller: Any) -> None:
        source = ModelOptions.model_validate(target).source  # the look-up draft's vocabulary
        self.draft = Draft(draft, source)
        # last: its torch threads hold
        self.verifier = Verifier(target)
        super().__init__(LocalHandle(self.draft), LocalHandle(self.verifier), controller)

    async def draft_info(self) -> dict[str, Any]:
        return await self.draft.info()

    async def verifier_info(self) -> dict[str, Any]:
        return await self.verifier.info()

    async def verifier_prompt_logprobs(self, prompt_ids: list[int], top: int) -> PromptLogprobs:
        return await self.verifier.prompt_logprobs(prompt_ids, top)

    async def check_health(self) -> None:
        """Serve's health check: a lost tensor-parallel rank of either model fails the pair."""
        await self.verifier.check_health()
        await self.draft.check_health()
