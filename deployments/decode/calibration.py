"""The cost model's calibration of a deployed pair, built once per router replica.

What `dsbd generate` measures in one process (`dsbd_core.models.calibrate.calibrate`), measured
here through the deployments, since a served iteration pays what an in-process one does not
(the calls between router, draft and verifier): the forward costs the replicas measured at
start-up, the engine's work (measured in the router's process), the pair's pass rate per drafted
layer, and the seconds of a whole served iteration at each fixed depth with the draft's catch-up
(`dsbd_core.algorithm.policy.iteration_timer`). The decodes run through `run`, which the router's
session module supplies (one served session per prompt, fixed knobs); their results are cached
per machine and pair like the in-process ones, so that every router on the machine starts from
the same figures and a seeded request's knobs do not depend on which router runs it. The
calibration decodes count in the server's metrics and traces as sessions of their own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.decode.state import RouterState
from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.policy.control import Controller
from dsbd_core.algorithm.policy.cost_model import Calibration, ForwardCosts
from dsbd_core.algorithm.policy.iteration_timer import summarise, timing_plan
from dsbd_core.models.calibrate import (
    ITERATION_TOKENS,
    PASS_RATE_TOKENS,
    PassCounter,
    assemble,
    iteration_config,
    iteration_fields,
    pass_rate_config,
    read_cached,
    store_cached,
)

# run(vocab_size, config, controller, prompt): one served decode of `prompt` with `controller`
RunSession = Callable[[int, SamplingConfig, Controller, list[int]], Awaitable[Any]]


async def pair_calibration(router: RouterState, run: RunSession) -> Calibration | None:
    """The deployed pair's calibration, built once per router replica (the first adaptive
    request waits for it). None where a replica reports no costs (a tensor-parallel target):
    the requests then run fixed knobs. A measurement that fails leaves its fields unset (the
    policy's priors, the parts' sum) until it is retried (`RouterState.calibration`), and the
    router's status says why (`/v1/dsbd/status`: router.calibration)."""

    async def build() -> Calibration | None:
        verifier = await router.handles.verifier.info.remote()
        draft = await router.handles.draft.info.remote()
        if verifier.get("costs") is None or draft.get("costs") is None:
            return None
        description = (
            f"target {verifier['dtype']}; draft {draft['dtype']}, "
            f"{draft.get('variant') or 'as loaded'}"
        )
        calibration = await asyncio.to_thread(
            assemble,
            ForwardCosts.model_validate(verifier["costs"]),
            ForwardCosts.model_validate(draft["costs"]),
            int(verifier["vocab_size"]),
            draft.get("support_size"),
            description,
        )
        update: dict[str, Any] = {}
        try:
            update["pass_rates"] = await pair_pass_rates(verifier, draft, run) or None
            update.update(await pair_iteration_seconds(verifier, draft, run, router.layout))
        except Exception as error:  # what was measured stands; retried later (state.py)
            router.failed_calibration(error)
        return calibration.model_copy(update=update)

    return await router.calibration(build)


def _parts(
    verifier: dict[str, Any], draft: dict[str, Any], tokens: int, layout: str | None = None
) -> dict[str, Any] | None:
    """What a served measurement depends on (its cache key), None where the replicas do not
    report their identity or the prompts. `layout`: a served iteration's seconds depend on it
    (a split iteration pays two Serve calls, a co-located one none); pass rates do not."""
    inputs = verifier.get("pass_rate_inputs")
    if inputs is None or verifier.get("identity") is None or draft.get("identity") is None:
        return None
    return {
        **({"layout": layout} if layout is not None else {}),
        "target": verifier["identity"],
        "draft": draft["identity"],
        "prompts": inputs["prompts"],
        "tokens": tokens,
        "stop": tuple(inputs["stop_ids"]),
    }


async def pair_pass_rates(
    verifier: dict[str, Any], draft: dict[str, Any], run: RunSession
) -> list[float]:
    """The pair's pass rate per drafted layer, as `dsbd generate` measures it (DSBD at the
    default settings on the pass-rate prompts, `calibrate.measure_pass_rates`), decoded through
    the deployments, concurrently; measured once per machine and pair."""
    parts = _parts(verifier, draft, PASS_RATE_TOKENS)
    if parts is None:
        return []

    async def measure() -> list[float]:
        config = pass_rate_config(parts["stop"])
        counter = PassCounter(config)
        vocab_size = int(verifier["vocab_size"])
        await asyncio.gather(*(run(vocab_size, config, counter, p) for p in parts["prompts"]))
        return counter.rates()

    return [float(x) for x in await _cached("served-pass-rates", parts, measure)]


async def pair_iteration_seconds(
    verifier: dict[str, Any], draft: dict[str, Any], run: RunSession, layout: str = "split"
) -> dict[str, Any]:
    """The `Calibration` fields of whole served iterations (`calibrate.iteration_fields`):
    each depth and a probe decoded one session at a time through the deployments, as
    `calibrate.measure_iteration_seconds` does in one process; measured once per machine and
    pair. Empty where the replicas do not report what it needs."""
    parts = _parts(verifier, draft, ITERATION_TOKENS, layout)
    if parts is None:
        return {}

    async def measure() -> dict[str, Any]:
        config = iteration_config(parts["stop"])
        vocab_size = int(verifier["vocab_size"])
        plan = timing_plan(parts["prompts"], config)
        for prompt, timer in plan:
            await run(vocab_size, config, timer, prompt)
        seconds, catch_up = summarise([timer for _, timer in plan], config.gamma)
        return {"iteration_s": seconds, "catch_up_s": catch_up}

    timed = await _cached("served-iteration-seconds", parts, measure)
    return iteration_fields(timed, parts["stop"])


async def _cached(name: str, parts: dict[str, Any], measure: Callable[[], Awaitable[Any]]) -> Any:
    """What `measure()` found for `parts` on this machine: decoded once, then read from the
    calibration cache (`calibrate.read_cached` / `store_cached`)."""
    text = await asyncio.to_thread(read_cached, name, parts)
    if text is None:
        text = json.dumps(await measure())
        await asyncio.to_thread(store_cached, name, parts, text)
    return json.loads(text)
