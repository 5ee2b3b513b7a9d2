"""Run a recorded scorer script on N local ranks (processes joined by gloo on loopback).

A script is the exact sequence of scorer calls a real decode made on one device (recorded by
`RecordingScorer`), with the outputs it got. Replaying it on every rank of a tensor-parallel
group gives each forward exactly the same inputs, so its outputs can be compared with TP=1
within float tolerance: a replayed comparison cannot drift the way two sampled decodes would
after one near-tie.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from dsbd_core import SamplingConfig, generate_batch
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots
from dsbd_core.models.options import INIT_TIMEOUT_S
from dsbd_core.models.tensor_parallel import (
    ShardedScorer,
    init_group,
    load_sharded,
    shard_devices,
)
from dsbd_core.models.transformer_scorer import TransformerScorer

Script = list[tuple[str, Any]]


class RecordingScorer:
    """Wraps a scorer and records every call (and every forward's output)."""

    def __init__(self, inner: Any, *, round_trip_sessions: bool = True) -> None:
        self.inner = inner
        self.script: Script = []
        self.round_trip = round_trip_sessions

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def set_roots(self, roots: Roots) -> None:
        if self.round_trip:  # the caches leave the scorer and come back, as in a replica
            self.script.append(("round_trip", None))
            self.inner.import_sessions(self.inner.export_sessions())
        self.script.append(("set_roots", copy.deepcopy((roots,))))
        self.inner.set_roots(roots)

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        out = self.inner.forward(layers)
        self.script.append(("forward", (copy.deepcopy(list(layers)), copy.deepcopy(out))))
        return out

    def release(self) -> None:
        self.inner.release()


VOCAB = 48


def save_tiny(
    arch: str,
    path: Path,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 3,
    intermediate: int = 64,
) -> Path:
    """A tiny fp32 Llama (untied head) or Qwen2 (q/k/v biases, tied embeddings), saved."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    with torch.no_grad():  # sharper distributions than the default init, so beams differ
        model.get_output_embeddings().weight.mul_(6.0)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def record_decode(
    model_dir: Path,
    draft_dir: Path,
    prompts: list[list[int]] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Script, list[ForestLogprobs]]:
    """A batched DSBD decode on one device: the target's recorded calls and outputs."""
    target = RecordingScorer(ShardedScorer(load_sharded(model_dir, dtype=dtype)).scorer)
    draft = TransformerScorer(load_sharded(draft_dir, dtype=dtype))
    prompts = prompts or [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
    cfg = SamplingConfig(max_new_tokens=10, eos_token_ids=(), seed=11, width=3, gamma=3)
    results = generate_batch("dsbd", target, prompts, cfg, draft)
    assert max(r.stats.target_forward_passes for r in results) >= 3  # several compactions
    outputs = [args[1] for kind, args in target.script if kind == "forward"]
    return target.script, outputs


def replay(scorer: ShardedScorer, script: Script) -> list[ForestLogprobs | None]:
    """Run the script's calls on one rank; returns the forwards' outputs (None off rank 0)."""
    outputs = []
    for kind, args in script:
        if kind == "round_trip":
            scorer.import_sessions(scorer.export_sessions())
        elif kind == "set_roots":
            scorer.set_roots(*args)
        else:
            outputs.append(scorer.forward(args[0]))
    return outputs


def _rank_main(
    rank: int,
    world: int,
    store: str,
    model_dir: str,
    dtype: torch.dtype,
    script: Script,
    out: str,
    accelerator: str | None,
    timeout_s: float,
) -> None:
    torch.set_num_threads(1)
    if accelerator is not None:  # what a CUDA build of torch answers, GPU visible or not
        torch._C._get_accelerator = lambda check=False: torch.device(accelerator)
        os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it: the rank, not a GPU of ours
    init_group(rank, world, store, device="cpu", timeout_s=timeout_s)
    try:
        model = load_sharded(model_dir, dtype=dtype, device="cpu")
        scorer = ShardedScorer(model)
        outputs = replay(scorer, script)
        scorer.release()
        group = dist.distributed_c10d._get_default_group()
        report = {
            "stored": scorer.stored,
            "local_fraction": local_fraction(model),
            "devices": shard_devices(model),
            "cuda_initialized": torch.cuda.is_initialized(),
            "group_timeout_s": group._get_backend(torch.device("cpu")).options._timeout,
        }
        torch.save({**report, "outputs": outputs} if rank == 0 else report, f"{out}.rank{rank}")
    finally:
        dist.destroy_process_group()


def local_fraction(model: torch.nn.Module) -> float:
    """Share of the attention/MLP projection weights this rank holds (1/world when sharded)."""
    local = total = 0
    for name, param in model.named_parameters():
        if name.endswith(("proj.weight",)):
            total += param.numel()
            local += param.to_local().numel() if hasattr(param, "to_local") else param.numel()
    return local / total


def run_on_ranks(
    world: int,
    model_dir: Path,
    script: Script,
    tmp: Path,
    dtype: torch.dtype = torch.float32,
    *,
    accelerator: str | None = None,
    timeout_s: float = INIT_TIMEOUT_S,
) -> list[ForestLogprobs]:
    """Replay `script` on `world` cpu ranks; rank 0's forward outputs. Every rank must have
    freed every cache, held 1/world of the weights, all of it on cpu, never initialised CUDA,
    and run its group with `timeout_s`. `accelerator` is what torch reports in the ranks
    (`torch._C._get_accelerator`): "cuda" plays a CUDA build of torch, as on a GPU host."""
    out = tmp / f"tp{world}"
    # Each rank forks from a forkserver that imported this module (torch, transformers, the
    # engine) once per test process; a spawned rank would import them all again.
    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(
        _rank_main,
        args=(
            world,
            f"file://{tmp}/store-tp{world}",
            str(model_dir),
            dtype,
            script,
            str(out),
            accelerator,
            timeout_s,
        ),
        nprocs=world,
        join=True,
        start_method="forkserver",
    )
    reports = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(world)]
    for report in reports:
        assert report["stored"] == 0  # every cache handed out came back or was freed
        assert abs(report["local_fraction"] - 1 / world) < 1e-9  # really sharded
        assert report["devices"] == ["cpu"]
        assert report["cuda_initialized"] is False
        assert report["group_timeout_s"].total_seconds() == timeout_s
    return reports[0]["outputs"]


def max_difference(got: list[ForestLogprobs], want: list[ForestLogprobs]) -> float:
    """Largest |difference| over every root and node log-prob of every forward."""
    assert len(got) == len(want)
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        assert (a.roots is None) == (b.roots is None)
        pairs = list(zip(a.layers, b.layers, strict=True))
        if a.roots is not None:
            pairs.append((a.roots, b.roots))
        for x, y in pairs:
            assert x.shape == y.shape
            worst = max(worst, float((x - y).abs().max()) if x.numel() else 0.0)
    return worst
