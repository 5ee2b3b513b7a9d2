"""The co-located layout's replica (deployments/decode/pair.py) in this process, without Ray:
its decode loops drive the draft and the verifier of the same process through local handles, and
every served decode is the in-process decode draw for draw (float64), alone and with concurrent
requests batched into one forward per layer; the ingress reads both models' info through the pair.
The served path is in tests/serving/test_serve_run.py (a co-located model over HTTP with the openai
client) and tests/serving/test_faults.py (`/fpair`: a pair replica killed mid-decode, every decode
exact)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deployments.app import AppArgs
from deployments.decode.local_handles import LocalHandle, SideHandle
from deployments.decode.pair import Pair
from deployments.decode.session_registry import SessionRegistry
from deployments.messages import DecodeCall
from dsbd_core import SamplingConfig
from dsbd_core.algorithm.drivers.decoders import generate
from dsbd_core.algorithm.methods import method_config
from dsbd_core.models import load_causal_lm, load_tokenizer
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.serving_harness import CASES
from tests.support.tiny_models import build_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    target, draft = build_pair(tmp_path_factory.mktemp("pair") / "models")
    options = {"dtype": "float64", "batch_wait_s": 0.01}
    controller = SessionRegistry(None, 60.0)
    replica = Pair(
        {"source": str(target), **options},
        {"source": str(draft), **options},
        LocalHandle(controller),
    )
    _, stop_ids = load_tokenizer(str(target))
    scorers = {
        side: TransformerScorer(load_causal_lm(str(path), dtype=torch.float64).model)
        for side, path in (("target", target), ("draft", draft))
    }
    # one event loop for the module: the replicas' batchers and locks belong to the loop that
    # first ran them, as in a Serve replica
    loop = asyncio.new_event_loop()
    yield {
        "replica": replica,
        "stop_ids": stop_ids,
        "scorers": scorers,
        "run": loop.run_until_complete,
    }
    pending = asyncio.all_tasks(loop)  # the replicas' TTL sweepers
    for task in pending:
        task.cancel()
    if pending:  # gather() of nothing asks for the thread's current loop, which may be unset
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def _call(pair: dict[str, Any], method: str, prompt: list[int], **knobs: Any) -> DecodeCall:
    config = SamplingConfig(eos_token_ids=pair["stop_ids"], **knobs)
    return DecodeCall(
        prompt_ids=prompt,
        vocab_size=pair["replica"].draft.vocab_size,
        config=method_config(method, config),
        adaptive=False,
    )


def _reference(pair: dict[str, Any], method: str, prompt: list[int], **knobs: Any) -> Any:
    config = SamplingConfig(eos_token_ids=pair["stop_ids"], **knobs)
    scorers = pair["scorers"]
    return generate(method, scorers["target"], prompt, config, draft=scorers["draft"])


def _same(got: Any, want: Any) -> None:
    assert [b.token_ids for b in got.result.beams] == [b.token_ids for b in want.beams]
    for a, b in zip(got.result.beams, want.beams, strict=True):
        assert abs(a.log_likelihood - b.log_likelihood) < 1e-9
    assert got.result.stats.as_dict() == want.stats.as_dict()


@pytest.mark.parametrize(("method", "knobs"), CASES)
def test_a_pair_decodes_what_the_in_process_engine_decodes(pair, method, knobs) -> None:
    knobs = {"seed": 11, "max_new_tokens": 14, **knobs}
    call = _call(pair, method, [5, 17, 42, 99, 7], **knobs)
    got = pair["run"](pair["replica"].decode(call))
    _same(got, _reference(pair, method, [5, 17, 42, 99, 7], **knobs))
    serving = got.serving
    # an iteration is two calls inside this process: nothing crossed Serve or the object store
    assert set(serving["router_received"]) <= {"VerifyReply", "Knobs"}
    assert all(serving["verify_cache_hit"][1:])


def test_concurrent_decodes_of_a_pair_share_its_forwards_and_stay_exact(pair) -> None:
    prompts = [[3 + i, 8, 13 + i] for i in range(6)]
    knobs = [
        {"seed": i, "max_new_tokens": 20, "width": 2 + i % 2, "gamma": 1 + i % 3} for i in range(6)
    ]

    async def all_at_once() -> list[Any]:
        calls = [_call(pair, "dsbd", p, **k) for p, k in zip(prompts, knobs, strict=True)]
        return await asyncio.gather(*(pair["replica"].decode(c) for c in calls))

    results = pair["run"](all_at_once())
    assert max(max(r.serving["verify_batch_requests"]) for r in results) >= 2
    assert max(max(r.serving["draft_batch_requests"]) for r in results) >= 2
    for prompt, k, got in zip(prompts, knobs, results, strict=True):
        _same(got, _reference(pair, "dsbd", prompt, **k))


def test_the_ingress_reads_both_models_through_the_pair(pair) -> None:
    handle = LocalHandle(pair["replica"])

    async def infos() -> tuple[dict, dict, dict]:
        draft, verifier = SideHandle(handle, "draft"), SideHandle(handle, "verifier")
        return (
            await draft.info.remote(),
            await verifier.info.remote(),
            await handle.info.remote(),
        )

    draft, verifier, loop = pair["run"](infos())
    assert draft["identity"] != verifier["identity"] and draft["pid"] == verifier["pid"]
    assert loop["layout"] == "colocated" and loop["pid"] == verifier["pid"]


def test_the_layout_is_colocated_on_one_cuda_device_by_default(tmp_path: Path) -> None:
    cuda = {"device": "cuda"}
    args = {
        "target": {"source": "smollm2", **cuda},
        "draft": {"source": "smollm2-draft", **cuda},
        "verifier_resources": {"num_gpus": 1},
    }
    assert AppArgs.model_validate(args).colocated  # the draft shares the pair's GPU
    assert not AppArgs().colocated  # CPU: the split layout
    assert not AppArgs.model_validate(
        {**args, "layout": "split", "draft_resources": {"num_gpus": 1}}
    ).colocated
    tp = {"target": {"source": "smollm2", "device": "cuda", "tp_size": 2}}
    assert not AppArgs.model_validate(tp).colocated  # a tensor-parallel verifier stays split
    with pytest.raises(ValueError, match="draft.device='cuda' needs draft_resources.num_gpus"):
        AppArgs.model_validate({**args, "layout": "split"})


def test_a_pairs_served_iterations_are_calibrated_apart_from_the_split_layouts(pair) -> None:
    """A co-located iteration pays no Serve call: the calibration caches its iteration seconds
    under the layout, so a split router on the same machine never reads them (nor the
    reverse); pass rates do not depend on the layout and are shared."""
    from deployments.decode.calibration import _parts

    replica = pair["replica"]
    assert replica.state.layout == "colocated"
    verifier, draft = pair["run"](replica.verifier_info()), pair["run"](replica.draft_info())
    split, colocated = (_parts(verifier, draft, 8, layout) for layout in ("split", "colocated"))
    assert split is not None and colocated is not None and split != colocated
    assert _parts(verifier, draft, 8) == {k: v for k, v in split.items() if k != "layout"}


def test_dsbd_serve_puts_the_embedded_pair_in_one_replica_on_a_gpu(monkeypatch) -> None:
    """Without --config, `dsbd serve` on a machine with a visible GPU serves the embedded pair
    on cuda in one Pair replica (layout auto); without one, as before (CPU, split)."""
    import torch

    from dsbd.serve_command import embedded_args, load_config

    assert embedded_args() == {} or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    schema = load_config(None, "127.0.0.1", 8000)
    args = AppArgs.model_validate(schema.applications[0].args)
    assert args.target.device == args.draft.device == "cuda"
    assert args.colocated and args.verifier_resources.num_gpus == 1
    forced = load_config(None, "127.0.0.1", 8000, layout="split")
    split = AppArgs.model_validate(forced.applications[0].args)
    assert not split.colocated  # the draft and the verifier share the GPU, half each
    assert split.verifier_resources.num_gpus == split.draft_resources.num_gpus == 0.5
