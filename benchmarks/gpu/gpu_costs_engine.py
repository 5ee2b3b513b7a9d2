"""The engine runs that benchmarks/gpu/gpu_costs.py times: every decode it times is here.

The project's one decode loop (`dsbd_core.algorithm.drivers.loop.Decode`) decodes a random prompt
of the given context length with `TimedScorer`s (gpu_costs_timing.py) over the two models, one
iteration at a time as `run_decode` drives it, so what is timed is the engine's own path, not
an approximation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.drivers.loop import Decode, Propose, Verify
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.scorer import drive

try:  # `python benchmarks/gpu/gpu_costs.py`: benchmarks/gpu/ is on sys.path
    from gpu_costs_timing import (
        BeamCost,
        Bench,
        DsbdCost,
        Iteration,
        TimedScorer,
        median_int,
        ms,
        synchronize,
    )
except ModuleNotFoundError:  # imported from the repository root (tests load it by path)
    from benchmarks.gpu.gpu_costs_timing import (
        BeamCost,
        Bench,
        DsbdCost,
        Iteration,
        TimedScorer,
        median_int,
        ms,
        synchronize,
    )


def timed_iterations(
    config: SamplingConfig,
    target: TimedScorer,
    draft: TimedScorer | None,
    prompt: list[int],
    warmup: int,
    repeats: int,
    device: torch.device,
    graph: bool = False,
) -> list[Iteration]:
    """Drive the decode loop as `run_decode` does and time `repeats` iterations (from sending
    the previous outcome, which advances the state, to this iteration's outcome)."""
    timers = [t for t in (target, draft) if t is not None]
    method = "dsbd" if draft is not None else "beam"  # the config as given
    decode = Decode(
        method_config(method, config), target.vocab_size, [prompt], device=device, graph=graph
    )
    steps, vocab = decode.steps(), target.vocab_size
    answer = None
    out: list[Iteration] = []
    try:
        for index in range(warmup + repeats):
            for timer in timers:
                timer.calls.clear()
            synchronize(target.device)
            start = time.perf_counter()
            try:
                call = steps.send(answer)
            except StopIteration:
                raise RuntimeError("token budget spent before the last timed iteration") from None
            if isinstance(call, Propose):
                assert draft is not None
                call = steps.send(drive(draft, call.call.propose_steps(vocab)))
            assert isinstance(call, Verify)
            answer = drive(target, call.call.verify_steps(vocab, call.forest))
            synchronize(target.device)
            seconds = time.perf_counter() - start
            if index >= warmup:
                drafts = list(draft.calls) if draft is not None else []
                iteration = Iteration(seconds, drafts, list(target.calls))
                out.append(_checked(iteration, config.gamma if draft is not None else 0))
    finally:
        steps.close()
        for timer in timers:
            timer.release()
    return out


def _checked(iteration: Iteration, gamma: int) -> Iteration:
    """Refuse a timing of anything but the calls claimed: gamma draft calls, one target call."""
    if len(iteration.draft_calls) != gamma or len(iteration.target_calls) != 1:
        raise RuntimeError(
            f"expected {gamma} draft calls and 1 target call per iteration, got "
            f"{len(iteration.draft_calls)} and {len(iteration.target_calls)}"
        )
    return iteration


def random_prompt(bench: Bench, context: int) -> list[int]:
    """`context` random token ids: the prefix whose KV cache every timed call attends to."""
    generator = torch.Generator().manual_seed(bench.seed + context)
    vocab = bench.target.config.vocab_size
    return torch.randint(0, vocab, (context,), generator=generator).tolist()


def sampling_config(bench: Bench, width: int, gamma: int) -> SamplingConfig:
    """Config of a timed run: no EOS and enough budget that every iteration drafts gamma."""
    iterations = bench.warmup + bench.repeats + 1
    return SamplingConfig(
        width=width,
        gamma=gamma,
        threshold=bench.threshold,
        w_min=1,
        seed=bench.seed,
        max_new_tokens=iterations * (gamma + 1) + 1,
        eos_token_ids=(),
    )


def time_beam(bench: Bench, context: int, width: int) -> BeamCost:
    """(c) beam sampling at width W: the engine with no draft, one target call per step."""
    target = TimedScorer(bench.scorer("target"), bench.device)
    config = sampling_config(bench, width, 1)
    runs = timed_iterations(
        config,
        target,
        None,
        random_prompt(bench, context),
        bench.warmup,
        bench.repeats,
        bench.engine_device,
        bench.verify_graph,
    )
    return BeamCost(
        context=context,
        width=width,
        beam_step_ms=ms([r.target_calls[0].seconds for r in runs]),
        host_ms=ms([r.host_seconds for r in runs]),
        iterations=len(runs),
        rows=median_int([r.target_calls[0].rows for r in runs]),
        tokens_per_row=median_int([r.target_calls[0].tokens_per_row for r in runs]),
    )


def time_dsbd(bench: Bench, context: int, width: int, gamma: int) -> DsbdCost:
    """(a) draft calls and (b) the forest verification of DSBD iterations at (W, gamma)."""
    target = TimedScorer(bench.scorer("target"), bench.device)
    draft = TimedScorer(bench.scorer("draft"), bench.device)
    config = sampling_config(bench, width, gamma)
    runs = timed_iterations(
        config,
        target,
        draft,
        random_prompt(bench, context),
        bench.warmup,
        bench.repeats,
        bench.engine_device,
        bench.verify_graph,
    )
    return DsbdCost(
        context=context,
        width=width,
        gamma=gamma,
        draft_root_ms=ms([r.draft_calls[0].seconds for r in runs]),
        draft_layer_ms=ms([c.seconds for r in runs for c in r.draft_calls[1:]]),
        draft_iteration_ms=ms([sum(c.seconds for c in r.draft_calls) for r in runs]),
        verify_ms=ms([r.target_calls[0].seconds for r in runs]),
        host_ms=ms([r.host_seconds for r in runs]),
        iterations=len(runs),
        verify_rows=median_int([r.target_calls[0].rows for r in runs]),
        verify_tokens_per_row=median_int([r.target_calls[0].tokens_per_row for r in runs]),
    )


def measure_costs(
    bench: Bench,
    contexts: Sequence[int],
    widths: Sequence[int],
    gammas: Sequence[int],
    progress: bool,
) -> tuple[list[BeamCost], list[DsbdCost]]:
    """Every (context, W) beam step and every (context, W, gamma) DSBD iteration, in order."""
    from tqdm.auto import tqdm

    beams: list[BeamCost] = []
    dsbd: list[DsbdCost] = []
    # the pool long enough for the longest decode (sampling_config's budget), so that no pool
    # regrows (and recaptures) inside a timed iteration
    budget = (bench.warmup + bench.repeats + 1) * (max(gammas, default=0) + 1) + 1
    bench.capture(rows=max(widths), length=max(contexts) + budget + 8)
    total = len(contexts) * len(widths) * (1 + len(gammas))
    with tqdm(total=total, disable=not progress, dynamic_ncols=True, unit="config") as bar:
        for context in contexts:
            for width in widths:
                bar.set_postfix_str(f"L={context} W={width} beam")
                beam = time_beam(bench, context, width)
                beams.append(beam)
                bar.update()
                for gamma in gammas:
                    bar.set_postfix_str(f"L={context} W={width} gamma={gamma}")
                    cost = time_dsbd(bench, context, width, gamma)
                    cost.verify_over_beam_step = cost.verify_ms / beam.beam_step_ms
                    dsbd.append(cost)
                    bar.update()
    return beams, dsbd
