"""A lost cache is rebuilt bit for bit by replaying the session's iterations (issue 21).

A seeded decode whose draft or target cache is lost (its replica died, a retried iteration
found the cache one iteration ahead) must still decode what it decodes in-process. A re-prefill
builds the cache in one forward of other shapes, so its last bits differ; the replay
(`dsbd_core.algorithm.drivers.replay`) re-runs the session's own iterations. The driver below is the
serving router's logic in one process (`Lineage.tag`, `ReplayNeeded` -> send the history,
`Lineage.record`) over two `SessionBatcher`s, the replicas' batchers, with caches dropped or
iterations redone on purpose. Asserted: the caches after every iteration equal, bit for bit,
those of the run that lost nothing, and the tokens equal `generate` alone.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dsbd_core import SamplingConfig
from dsbd_core.algorithm.drivers.decoders import generate
from dsbd_core.algorithm.drivers.loop import Decode, Propose, Verify
from dsbd_core.algorithm.drivers.replay import Lineage, ReplayNeeded, draft_job, verify_job
from dsbd_core.algorithm.drivers.session_batch import Job, SessionBatcher
from dsbd_core.algorithm.methods import method_config
from dsbd_core.algorithm.sequences.state import NO_FOREST
from dsbd_core.models.loading import load_causal_lm
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.cpu import needs_amx
from tests.support.tiny_models import build_pair


@dataclass
class Faults:
    """What goes wrong: caches dropped before a side's call of an iteration ("draft", 3), an
    iteration whose draft side runs twice (the verifier died after it: a retry), and whether the
    jobs are exact (replay) or not (re-prefill, the control)."""

    drop: set[tuple[str, int]] = field(default_factory=set)
    redo: set[int] = field(default_factory=set)
    exact: bool = True
    asked: int = 0  # ReplayNeeded answers seen
    lineages: list[Lineage] = field(default_factory=list)  # the decodes' (what the router keeps)
    replayed: int = 0  # past iterations re-run


def _run_side(
    batcher: SessionBatcher,
    keys: list[str],
    calls: list,
    make,
    faults: Faults,
    lineages: list[Lineage],
) -> list:
    """One side of an iteration for every request, as the router sends it: history only after
    a replica answered `ReplayNeeded`."""
    values: list = [None] * len(keys)
    todo, history = list(range(len(keys))), False
    while todo:
        jobs = []
        for i in todo:
            sent = lineages[i].tag(calls[i], history=history) if faults.exact else calls[i]
            jobs.append(make(keys[i], sent))
        got, report = batcher.run(jobs)
        faults.replayed += sum(report.replayed.values())
        for i, value in zip(todo, got, strict=True):
            values[i] = value
        todo = [i for i in todo if isinstance(values[i], ReplayNeeded)]
        faults.asked += len(todo)
        assert not (todo and history), "a replica asked twice"
        history = True
    for value in values:
        assert not isinstance(value, BaseException), value
    return values


def decode(models: tuple, requests: list[tuple[list[int], SamplingConfig]], faults: Faults):
    """Decode the requests in lockstep; returns their beams and each iteration's cache bits."""
    target_model, draft_model = models
    target = SessionBatcher(TransformerScorer(target_model))
    draft = SessionBatcher(TransformerScorer(draft_model))
    vocab = target.scorer.vocab_size
    keys = [f"r{i}" for i in range(len(requests))]
    loops = [Decode(method_config("dsbd", config), vocab, [p]).steps() for p, config in requests]
    lineages = faults.lineages = [Lineage() for _ in requests]
    waiting = {i: next(loop) for i, loop in enumerate(loops)}
    beams, bits, iteration = {}, [], 0
    while waiting:
        live = sorted(waiting)
        for side, batcher in (("draft", draft), ("target", target)):
            if (side, iteration) in faults.drop:
                for i in live:
                    batcher.release(keys[i])
        proposing = [i for i in live if isinstance(waiting[i], Propose)]
        calls = {i: waiting[i].call for i in live}
        for _ in range(2 if iteration in faults.redo else 1):
            forests = _run_side(
                draft,
                [keys[i] for i in proposing],
                [calls[i] for i in proposing],
                lambda k, c: draft_job(k, c, vocab),
                faults,
                [lineages[i] for i in proposing],
            )
        for i, forest in zip(proposing, forests, strict=True):
            waiting[i] = loops[i].send(forest)
        forest_of = {i: waiting[i].forest for i in live}
        assert all(isinstance(waiting[i], Verify) for i in live)
        outcomes = _run_side(
            target,
            [keys[i] for i in live],
            [calls[i] for i in live],
            lambda k, c, f=forest_of: verify_job(k, c, f[keys.index(k)], vocab),
            faults,
            [lineages[i] for i in live],
        )
        bits.append(
            {
                side: _cache_bits(batcher, keys)
                for side, batcher in (("draft", draft), ("target", target))
            }
        )
        for i, outcome in zip(live, outcomes, strict=True):
            forest = forest_of[i]
            lineages[i].record(
                calls[i],
                drafted=i in proposing,
                layers=forest.layers if forest is not NO_FOREST else [],
            )
            try:
                waiting[i] = loops[i].send(outcome)
            except StopIteration as stop:
                beams[i] = [b.token_ids for b in stop.value[0].beams]
                waiting.pop(i)
        iteration += 1
    return [beams[i] for i in range(len(requests))], bits


def _cache_bits(batcher: SessionBatcher, keys: list[str]) -> dict[str, list[torch.Tensor]]:
    out = {}
    for key in keys:
        entry = batcher._store.get(key)
        if entry is not None and entry.sessions[0] is not None:
            cache = entry.sessions[0].cache
            out[key] = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
    return out


def _equal_bits(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        for side in x:
            if x[side].keys() != y[side].keys():
                return False
            for key in x[side]:
                tensors = zip(x[side][key], y[side][key], strict=True)
                if not all(t.shape == u.shape and torch.equal(t, u) for t, u in tensors):
                    return False
    return True


def _faults() -> dict[str, Faults]:
    return {
        "target cache lost": Faults(drop={("target", 3)}),
        "draft cache lost": Faults(drop={("draft", 2)}),
        "both lost, twice": Faults(drop={("draft", 1), ("target", 1), ("target", 4)}),
        "draft ahead (retried iteration)": Faults(redo={2}),
    }


def _check(models: tuple, requests: list, alone: list) -> None:
    clean = Faults()
    beams, bits = decode(models, requests, clean)
    assert clean.asked == clean.replayed == 0
    assert beams == alone, "batched decodes differ from generate alone"
    history = [len(pickle.dumps(lineage.past)) / len(lineage.past) for lineage in clean.lineages]
    print(f"history the router keeps: {max(history) / 1024:.1f} KiB per iteration at most")
    for name, faults in _faults().items():
        got, got_bits = decode(models, requests, faults)
        print(f"{name}: asked {faults.asked}, replayed {faults.replayed} iterations")
        assert faults.replayed > 0, name
        assert _equal_bits(got_bits, bits), f"{name}: the replayed caches differ"
        assert got == alone, name


def _alone(models: tuple, requests: list) -> list:
    target, draft = models
    return [
        [
            b.token_ids
            for b in generate(
                "dsbd", TransformerScorer(target), prompt, config, draft=TransformerScorer(draft)
            ).beams
        ]
        for prompt, config in requests
    ]


@pytest.mark.slow
def test_a_lost_cache_is_replayed_bit_for_bit_tiny_float32(tmp_path: Path) -> None:
    """One request at a time (float32 is not batch-invariant: alone, nothing else can differ):
    every kind of loss rebuilds the caches bit for bit."""
    target, draft = build_pair(tmp_path)
    models = (
        load_causal_lm(str(target), dtype=torch.float32).model,
        load_causal_lm(str(draft), dtype=torch.float32).model,
    )
    request = ([40, 31, 32, 33], SamplingConfig(seed=5, max_new_tokens=16, width=3, gamma=2))
    _check(models, [request], _alone(models, [request]))


@needs_amx
@pytest.mark.slow  # loads SmolLM2: ~27 s, outside the quick loop
@pytest.mark.real_model
def test_a_lost_cache_is_replayed_bit_for_bit_smollm2_bfloat16() -> None:
    """The serving default here (bfloat16, AMX): three requests batched, caches lost and
    replayed batched; and the control: a re-prefill gives other bits."""
    models = (
        load_causal_lm("smollm2", dtype=torch.bfloat16).model,
        load_causal_lm("smollm2-draft", dtype=torch.bfloat16).model,
    )
    prompts = [list(range(100, 140)), [44, 57, 70, 83], [5, 6, 7, 8, 9, 10, 11]]
    requests = [
        (p, SamplingConfig(seed=7 + i, max_new_tokens=12, width=2 + i % 2, gamma=2))
        for i, p in enumerate(prompts)
    ]
    _check(models, requests, _alone(models, requests))
    _, bits = decode(models, requests, Faults())
    control = Faults(drop={("target", 3)}, exact=False)
    decode_bits = decode(models, requests, control)[1]
    assert control.replayed == 0
    assert not _equal_bits(decode_bits, bits), "a re-prefill gave the same bits: no control"


def test_a_job_without_history_asks_for_it() -> None:
    """An exact job whose cache is missing fails alone with ReplayNeeded; its batch mates run."""
    from dsbd_core.algorithm.scorer import ForestLogprobs

    class Scorer:
        vocab_size = 4

        def import_sessions(self, sessions):
            self.n = len(sessions)

        def export_sessions(self):
            return [object()] * self.n

        def set_roots(self, roots):
            pass

        def forward(self, layers):
            return ForestLogprobs(torch.zeros(self.n, 1, 4), [])

    from dsbd_core.algorithm.scorer import Roots, ScoreCall

    def steps():
        roots = Roots(
            torch.zeros(1, 1, 2, dtype=torch.long),
            torch.tensor([2]),
            torch.ones(1, 1, dtype=torch.bool),
            None,
        )
        yield ScoreCall(roots, [])
        return "done"

    batcher = SessionBatcher(Scorer())  # type: ignore[arg-type]
    values, report = batcher.run([Job("a", steps(), 4, 3, True), Job("b", steps())])
    assert isinstance(values[0], ReplayNeeded) and "iteration 3" in str(values[0])
    assert values[1] == "done" and report.requests == 1
