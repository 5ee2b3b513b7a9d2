"""Tensor parallelism (issue 5): a forest forward sharded over 2 CPU processes (gloo) gives the
logits of the unsharded model within 1e-5, over whole DSBD decodes, i.e. including cache
compaction, batching several sessions, and caches handed out and back as handles.

Tiny fp32 Llama (untied head) and Qwen2 (q/k/v biases, tied embeddings) with random weights,
built here. The decode is recorded once on one device and replayed on the ranks, so both sides
see the same calls (see tests/support/tp_harness.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsbd_core.algorithm.scorer import Roots
from dsbd_core.models import resolve_source
from dsbd_core.models.tensor_parallel import (
    ShardedScorer,
    TensorParallelError,
    check_split,
    init_group,
    load_sharded,
    model_config,
)
from tests.support.tp_harness import max_difference, record_decode, run_on_ranks, save_tiny

# "What is the capital of France?" and "def add(a, b): return a + b" in SmolLM2 token ids
SMOL_PROMPTS = [
    [1780, 314, 260, 3575, 282, 4649, 47],
    [1604, 803, 24, 81, 28, 278, 727, 1003, 253, 1232, 278],
]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_forest_logits_equal_tp1(arch: str, tmp_path: Path) -> None:
    model_dir = save_tiny(arch, tmp_path / "target")
    draft_dir = save_tiny(arch, tmp_path / "draft", seed=4)
    script, want = record_decode(model_dir, draft_dir)
    assert any(kind == "set_roots" and args[0].origin is not None for kind, args in script)
    got = run_on_ranks(2, model_dir, script, tmp_path)
    assert max_difference(got, want) < 1e-5


@pytest.mark.slow
def test_cpu_ranks_stay_on_cpu_where_torch_reports_cuda(tmp_path: Path) -> None:
    """`device: cpu` holds on a GPU host: there torch (a CUDA build) reports cuda as its
    accelerator, GPU visible or not, and transformers would build its mesh on cuda:LOCAL_RANK
    (LOCAL_RANK = the rank here, as torchrun sets it). Played by making the ranks' torch answer
    cuda; every rank must still load all of its shard on cpu without initialising CUDA (checked
    in `run_on_ranks`) and give TP=1's logits. Also: a group timeout other than the default
    reaches the group."""
    model_dir = save_tiny("llama", tmp_path / "target")
    script, want = record_decode(model_dir, save_tiny("llama", tmp_path / "draft", seed=4))
    got = run_on_ranks(2, model_dir, script, tmp_path, accelerator="cuda", timeout_s=900.0)
    assert max_difference(got, want) < 1e-5


def test_bad_device_and_timeout_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(TensorParallelError, match=r"device='mps'.*'cpu' or 'cuda\[:N\]'"):
        init_group(0, 1, f"file://{tmp_path}/store", device="mps")
    with pytest.raises(TensorParallelError, match=r"timeout_s=0: must be > 0"):
        init_group(0, 1, f"file://{tmp_path}/store", timeout_s=0)


def test_split_checked_naming_the_field(tmp_path: Path) -> None:
    model_dir = save_tiny("llama", tmp_path / "m", heads=4, kv_heads=2)
    config = model_config(model_dir)
    check_split(config, 1)
    check_split(config, 2)
    with pytest.raises(TensorParallelError, match=r"num_key_value_heads=2.*one of \[1, 2\]"):
        check_split(config, 4)
    # 4 divides the heads but not the KV heads: only sizes dividing every field are offered
    with pytest.raises(TensorParallelError, match=r"num_attention_heads=4.*one of \[1, 2\] for"):
        check_split(config, 3)
    with pytest.raises(TensorParallelError, match="tp_size must be >= 1"):
        check_split(config, 0)
    mlp = save_tiny("llama", tmp_path / "mlp", heads=8, kv_heads=8, intermediate=36)
    with pytest.raises(TensorParallelError, match=r"intermediate_size=36.*one of \[1, 2, 4\] for"):
        check_split(model_config(mlp), 8)


def test_handles_keep_caches_on_the_rank_until_discarded(tmp_path: Path) -> None:
    model_dir = save_tiny("llama", tmp_path / "m")
    scorer = ShardedScorer(load_sharded(model_dir, dtype=torch.float32))
    tokens = torch.tensor([[[1, 2, 3], [4, 5, 6]], [[7, 8, 0], [0, 0, 0]]])
    scorer.set_roots(
        Roots(tokens, torch.tensor([3, 2]), torch.tensor([[True, True], [True, False]]), None)
    )
    first = scorer.forward([])
    handles = scorer.export_sessions()
    assert [type(h).__name__ for h in handles] == ["SessionHandle", "SessionHandle"]
    assert scorer.stored == 2
    scorer.discard_sessions(handles[1:])
    assert scorer.stored == 1
    scorer.import_sessions([handles[0], None])
    assert scorer.stored == 0
    scorer.set_roots(
        Roots(tokens, torch.tensor([3, 2]), torch.tensor([[True, True], [True, False]]), None)
    )
    again = scorer.forward([])
    assert torch.allclose(again.roots, first.roots, atol=1e-6)


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_target_at_tp3_equals_tp1(tmp_path: Path) -> None:
    """SmolLM2-135M: 9 heads and 3 KV heads split over 3 ranks (one KV head each).

    In float64, so that TP's different summation order shows at 1e-12, not at float32's own
    rounding (measured: fp32 TP=1 and TP=3 both lie ~8e-5 from fp64 in log-prob, 7e-5 apart).
    """
    target = resolve_source("smollm2")
    script, want = record_decode(
        target, resolve_source("smollm2-draft"), prompts=SMOL_PROMPTS, dtype=torch.float64
    )
    got = run_on_ranks(3, target, script, tmp_path, dtype=torch.float64)
    assert max_difference(got, want) < 1e-5


@pytest.mark.real_model
def test_smollm2_uneven_split_is_refused_naming_the_heads() -> None:
    config = model_config("smollm2")
    # 9 divides the heads but not the 3 KV heads: [1, 3] are the sizes that split everything
    with pytest.raises(TensorParallelError, match=r"num_attention_heads=9.*one of \[1, 3\] for"):
        check_split(config, 2)
    with pytest.raises(TensorParallelError, match=r"num_key_value_heads=3.*one of \[1, 3\]"):
        check_split(config, 9)
