"""The static-shape decode path (`StaticScorer` over a `StaticKV` pool, fixed-shape steps):
the same tokens as the dynamic path for the same seeds, steps that compile as one graph, and a
pool whose rows are reused, evicted and grown without a wrong distribution."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from dsbd.bench.decode.measure import ForwardCounter
from dsbd_core import SamplingConfig, generate, generate_batch
from dsbd_core.algorithm.drivers.lockstep import Request, decode_lockstep
from dsbd_core.algorithm.drivers.session_batch import SessionBatcher
from dsbd_core.models.draft_variants import restrict_head
from dsbd_core.models.static_scorer import StaticScorer
from dsbd_core.models.static_step import (
    SLOT_BUCKETS,
    idle_inputs,
    note_replay,
    preparing_bucket,
    static_attention_for,
    step_function,
)
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support import golden_tokens as golden
from tests.support.tiny_models import tiny, tiny_model


@pytest.mark.slow
def test_golden_decodes_are_the_recorded_tokens_on_the_static_path() -> None:
    """Every method and config corner of the golden file, alone, batched and in lockstep
    through `SessionBatcher`s (continuous batching): float64, draw for draw."""
    expected = json.loads(golden.PATH.read_text())
    moved = []
    for name, method, fields in golden.CASES:
        for seed in golden.SEEDS:
            key = f"llama/{name}/seed{seed}"
            config = golden._config(fields, seed, 12)
            target, draft = golden._llama_models()
            alone = generate(
                method, StaticScorer(target), golden.PROMPTS[0], config, StaticScorer(draft)
            )
            target, draft = golden._llama_models()
            batch = generate_batch(
                method, StaticScorer(target), golden.PROMPTS, config, StaticScorer(draft)
            )
            got = {
                key + "/single": golden._summary(alone),
                key + "/batch": [golden._summary(r) for r in batch],
            }
            for k, value in got.items():
                if json.loads(json.dumps(value, sort_keys=True)) != expected[k]:
                    moved.append(k)
    requests = [
        (
            f"llama/{name}/seed{seed}/lockstep",
            method,
            golden._config(fields, seed, 10),
            golden.PROMPTS[seed % len(golden.PROMPTS)],
        )
        for name, method, fields in golden.CASES
        for seed in golden.SEEDS
    ]
    target, draft = golden._llama_models()
    target_scorer, draft_scorer = StaticScorer(target), StaticScorer(draft)
    results, _ = decode_lockstep(
        [Request(prompt, config, method) for _, method, config, prompt in requests],
        SessionBatcher(target_scorer),
        SessionBatcher(draft_scorer),
    )
    for (key, *_), result in zip(requests, results, strict=True):
        assert result.error is None
        if json.loads(json.dumps(golden._summary(result.result), sort_keys=True)) != expected[key]:
            moved.append(key)
    assert not moved, f"{len(moved)} decodes moved on the static path: {moved[:5]}"
    # every session handed its rows back (the batchers discard sessions as requests end)
    assert target_scorer._pool is not None and target_scorer._pool.rows_in_use() == 0


METHODS = [
    ("sample", {}),
    ("sps", {"gamma": 3}),
    ("beam", {"width": 3}),
    ("dsbd", {"width": 3, "gamma": 3, "threshold": None}),
    ("dsbd", {"width": 3, "gamma": 2, "threshold": 0.7, "draft_width": 4}),
    ("dsbd", {"width": 3, "gamma": 3, "threshold": 0.7, "lean_memory": True}),
    ("beam_search", {"width": 3}),
    ("spec_beam_search", {"width": 3, "gamma": 3}),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("method", "fields"), METHODS)
def test_float32_static_path_decodes_the_dynamic_paths_tokens(
    arch: str, method: str, fields: dict
) -> None:
    target, draft = tiny(arch, 1).float(), tiny(arch, 2).float()
    prompts = [[1, 2, 3, 4], [5, 6], [8, 9, 10, 11, 12, 13]]
    for seed in (0, 1):
        config = SamplingConfig(max_new_tokens=12, eos_token_ids=(0,), seed=seed, **fields)
        dynamic = generate_batch(
            method, TransformerScorer(target), prompts, config, TransformerScorer(draft)
        )
        static_target = StaticScorer(target)
        static = generate_batch(method, static_target, prompts, config, StaticScorer(draft))
        for got, want in zip(static, dynamic, strict=True):
            assert [b.token_ids for b in got.beams] == [b.token_ids for b in want.beams]
            for a, b in zip(got.beams, want.beams, strict=True):
                assert abs(a.log_likelihood - b.log_likelihood) < 1e-4
        assert static_target._pool is not None and static_target._pool.rows_in_use() == 0


def _model(vocab: int = 40) -> LlamaForCausalLM:
    return tiny_model(vocab, seed=0, positions=256, attn_implementation="sdpa")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "restricted-head"])
def test_steps_compile_as_one_graph_and_compute_the_eager_step(arch: str) -> None:
    """CPU-side evidence that the CUDA graphs can be captured: every bucket's step traces with
    `fullgraph=True` (any graph break raises) and computes what the eager step computes."""
    model = tiny("llama" if arch == "restricted-head" else arch, 3).float()
    if arch == "restricted-head":
        restrict_head(model, torch.tensor([0, 2, 3, 5, 7, 11, 13]))
    scorer = StaticScorer(model, rows=4, length=32)
    pool = scorer._pool
    assert pool is not None
    step = step_function(model, pool, "sdpa", torch.float32)
    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    for rows, slots in ((1, 1), (4, SLOT_BUCKETS[2])):
        inputs = idle_inputs(pool, rows, slots)
        inputs.input_ids[:] = torch.randint(0, 16, inputs.input_ids.shape)
        args = (inputs.input_ids, inputs.position_ids, inputs.write, inputs.allowed)
        with torch.inference_mode(), static_attention_for(model):
            want = step(*args)
            got = compiled(*args)
        assert got.shape == (rows, slots, 16)
        assert torch.equal(got, want)
    if arch == "restricted-head":  # every step answers K-wide, whoever calls it (capture too)
        assert scorer._step is not None
        assert scorer._step(idle_inputs(pool, 1, 1), bucketed=True).shape[-1] == 7


def test_bench_counts_graph_replays_which_run_no_forward_hook() -> None:
    """A captured bucket's replay runs no Python forward: `dsbd bench`'s pass counter adds the
    static step's replay count to its hook's, and leaves out paused blocks and captures."""
    model = _model()
    counter = ForwardCounter(model)
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]))
    note_replay(model)
    note_replay(model)
    assert counter.calls == 3
    with counter.paused(), torch.inference_mode():
        note_replay(model)
        model(torch.tensor([[3]]))
    assert counter.calls == 3
    with preparing_bucket(model), torch.inference_mode():  # capturing: not a decode's pass
        model(torch.tensor([[4]]))
    assert counter.calls == 3
    counter.reset()
    assert counter.calls == 0
    note_replay(model)
    assert counter.calls == 1
    counter.remove()


def test_pool_rows_are_reused_grown_and_evicted_without_a_wrong_distribution() -> None:
    target, draft = _model(), _model()
    config = SamplingConfig(width=3, gamma=2, max_new_tokens=30, seed=4, eos_token_ids=())
    want = generate(
        "dsbd",
        TransformerScorer(target.double()),
        [1, 2, 3],
        config,
        TransformerScorer(draft.double()),
    )
    # a pool far too small at first: it grows in rows and columns while decoding
    small = StaticScorer(target, rows=1, length=4)
    got = generate("dsbd", small, [1, 2, 3], config, StaticScorer(draft))
    assert [b.token_ids for b in got.beams] == [b.token_ids for b in want.beams]
    assert small._pool is not None and small._pool.regrowths >= 1
    assert small._pool.rows_in_use() == 0


class _EvictingScorer(StaticScorer):
    """Loses every session's rows between iterations (as an eviction does)."""

    def _start_session(self, b, tokens, length, alive, origin, old):  # noqa: ANN001, ANN202
        if old is not None and self._pool is not None:
            self._pool.free(old.cache)
        return super()._start_session(b, tokens, length, alive, origin, old)


def test_a_session_whose_rows_were_taken_reprefills_to_the_same_tokens() -> None:
    target, draft = _model().double(), _model().double()
    config = SamplingConfig(
        width=3, gamma=2, threshold=0.7, max_new_tokens=16, seed=2, eos_token_ids=()
    )
    want = generate("dsbd", TransformerScorer(target), [1, 2, 3], config, TransformerScorer(draft))
    got = generate("dsbd", _EvictingScorer(target), [1, 2, 3], config, _EvictingScorer(draft))
    assert [b.token_ids for b in got.beams] == [b.token_ids for b in want.beams]


def test_pool_evicts_the_least_recently_used_idle_rows_and_never_busy_ones() -> None:
    scorer = StaticScorer(_model(), rows=6, length=16, max_rows=6)
    pool = scorer._pool
    assert pool is not None
    first = pool.allocate(3, busy=set(), max_rows=6)
    second = pool.allocate(3, busy=set(), max_rows=6)
    pool.touch(first.base)  # `second` is now the least recently used
    third = pool.allocate(3, busy={first.base}, max_rows=6)
    assert pool.valid(first) and not pool.valid(second) and pool.valid(third)
    with pytest.raises(RuntimeError, match="all busy"):
        pool.allocate(3, busy={first.base, third.base}, max_rows=6)
    status = scorer.status()
    assert status["path"] == "static" and status["pool_rows"] == 6
    assert status["slot_buckets"] == list(SLOT_BUCKETS)


def test_a_serving_replica_on_the_static_path_reports_it_and_frees_released_sessions(
    tmp_path: Path,
) -> None:
    """The draft deployment's class as Serve calls it, `decode_path: static` on CPU: a
    proposal runs on the pool, `info` (what /v1/dsbd/status shows) reports the ladder, and a
    released session hands its rows back."""
    from deployments.replicas.draft import Draft
    from tests.support.iteration_calls import first_call
    from tests.support.tiny_models import build_pair

    source = build_pair(tmp_path)[1]
    replica = Draft({"source": str(source), "dtype": "float64", "decode_path": "static"})
    assert isinstance(replica.scorer, StaticScorer)
    call = first_call(replica.vocab_size, [5, 6, 7])

    async def scenario() -> dict:
        await replica.propose("one", call)
        info = await replica.info()
        await replica.release("one")
        return info

    info = asyncio.run(scenario())
    assert info["decode_path"]["path"] == "static"
    assert info["decode_path"]["bucket_forwards"] >= 1
    assert replica.scorer._pool is not None and replica.scorer._pool.rows_in_use() == 0
