"""Tensor parallelism (issue 5): a forest forward sharded over 2 CPU processes (gloo) gives the
logits of the unsharded model within 1e-5, over whole DSBD decodes, i.e. including cache
compaction, batching several sessions, and caches handed out and back as handles.

Tiny fp32 Llama (untied head) and Qwen2 (q/k/v biases, tied embeddings) with random weights,
built here. The decode is recorded once on one device and replayed on the ranks, so both sides
see the same calls (see tests/tp_harness.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsbd_core.tensor_parallel import (
    ShardedScorer,
    TensorParallelError,
    check_split,
    load_sharded,
    model_config,
)
from tests.tp_harness import max_difference, record_decode, run_on_ranks, save_tiny


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_forest_logits_equal_tp1(arch: str, tmp_path: Path) -> None:
    model_dir = save_tiny(arch, tmp_path / "target")
    draft_dir = save_tiny(arch, tmp_path / "draft", seed=4)
    script, want = record_decode(model_dir, draft_dir)
    assert any(kind == "set_roots" and args[3] is not None for kind, args in script)
    got = run_on_ranks(2, model_dir, script, tmp_path)
    assert max_difference(got, want) < 1e-5


def test_split_checked_naming_the_field(tmp_path: Path) -> None:
    model_dir = save_tiny("llama", tmp_path / "m", heads=4, kv_heads=2)
    config = model_config(model_dir)
    check_split(config, 1)
    check_split(config, 2)
    with pytest.raises(TensorParallelError, match=r"num_key_value_heads=2.*one of \[1, 2\]"):
        check_split(config, 4)
    with pytest.raises(TensorParallelError, match="num_attention_heads=4"):
        check_split(config, 3)
    with pytest.raises(TensorParallelError, match="tp_size must be >= 1"):
        check_split(config, 0)


def test_handles_keep_caches_on_the_rank_until_discarded(tmp_path: Path) -> None:
    model_dir = save_tiny("llama", tmp_path / "m")
    scorer = ShardedScorer(load_sharded(model_dir, dtype=torch.float32))
    tokens = torch.tensor([[[1, 2, 3], [4, 5, 6]], [[7, 8, 0], [0, 0, 0]]])
    scorer.set_roots(tokens, torch.tensor([3, 2]), torch.tensor([[True, True], [True, False]]),
                     None)  # fmt: skip
    first = scorer.forward([])
    handles = scorer.export_sessions()
    assert [type(h).__name__ for h in handles] == ["SessionHandle", "SessionHandle"]
    assert scorer.stored == 2
    scorer.discard_sessions(handles[1:])
    assert scorer.stored == 1
    scorer.import_sessions([handles[0], None])
    assert scorer.stored == 0
    scorer.set_roots(tokens, torch.tensor([3, 2]), torch.tensor([[True, True], [True, False]]),
                     None)  # fmt: skip
    again = scorer.forward([])
    assert torch.allclose(again.roots, first.roots, atol=1e-6)
