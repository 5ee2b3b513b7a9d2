"""Checkpoints of a distillation run (`run_dir/state.pt`), for bit-exact resumption.

A checkpoint holds the trainable weights, the optimizer, the RNG state and the step (the data
order is a pure function of seed and epoch), so a resumed run is bit-identical to an
uninterrupted one. It is read onto the CPU (it may come from another device) and written
atomically, so either a whole checkpoint or the previous one is found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dsbd.distill.config import RESUMABLE_CHANGES, TrainConfig
from dsbd.distill.data import TeacherData
from dsbd.distill.draft import DraftSpec, make_draft
from dsbd.distill.files import atomic_save


@dataclass
class Trainee:
    """The draft being trained, its trainable parameters (in `named_parameters` order, with
    their names) and their optimizer: what a checkpoint saves of the model."""

    draft: Any
    names: list[str]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer

    @classmethod
    def create(cls, target_model, spec: DraftSpec, config: TrainConfig) -> Trainee:
        """A fresh draft for `target_model` (see `make_draft`) and its AdamW optimizer."""
        draft = make_draft(target_model, spec, config.seed)
        params = [p for p in draft.parameters() if p.requires_grad]
        names = [n for n, p in draft.named_parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98)
        )
        return cls(draft, names, params, optimizer)


@dataclass
class RunState:
    """Where a run stands: the step, the epoch and the step it began at, the training time so
    far and the held-out evaluations (the learning curve)."""

    step: int = 0
    epoch: int = 0
    epoch_start: int = 0
    elapsed: float = 0.0
    history: list[dict] = field(default_factory=list)


def read_checkpoint(path: Path) -> dict:
    """A checkpoint, read onto the CPU; the weights and the optimizer state are copied to the
    draft's device by `restore_checkpoint`."""
    return torch.load(path, map_location="cpu", weights_only=False)


def save_checkpoint(
    path: Path, settings: dict, data: TeacherData, run: RunState, trainee: Trainee
) -> None:
    """Write the run's checkpoint atomically (the RNG state is the global one, now)."""
    atomic_save(
        {
            "settings": settings,
            "shards": data.shard_names,
            "step": run.step,
            "epoch": run.epoch,
            "epoch_start": run.epoch_start,
            "elapsed_s": run.elapsed,
            "trainable": dict(
                zip(trainee.names, (p.detach().cpu() for p in trainee.params), strict=True)
            ),
            "optimizer": trainee.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "history": run.history,
        },
        path,
    )


def restore_checkpoint(state: dict, trainee: Trainee) -> RunState:
    """Load a checkpoint's weights, optimizer and RNG state into `trainee` and the process;
    returns where the run stood."""
    with torch.no_grad():
        for name, param in zip(trainee.names, trainee.params, strict=True):
            param.copy_(state["trainable"][name])
    trainee.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return RunState(
        step=state["step"],
        epoch=state["epoch"],
        epoch_start=state["epoch_start"],
        elapsed=state["elapsed_s"],
        history=state["history"],
    )


def check_resumable(saved: dict, current: dict) -> None:
    """Refuse to resume a checkpoint under settings that would change the result."""
    saved_train = {k: v for k, v in saved["train"].items() if k not in RESUMABLE_CHANGES}
    current_train = {k: v for k, v in current["train"].items() if k not in RESUMABLE_CHANGES}
    differences = [
        f"{section}: {saved[section]} -> {current[section]}"
        for section in ("spec", "cache")
        if saved[section] != current[section]
    ]
    differences += [
        f"{key}={saved_train[key]} -> {current_train.get(key)}"
        for key in saved_train
        if saved_train[key] != current_train.get(key)
    ]
    if differences:
        raise ValueError(
            "the checkpoint was made with other settings (" + "; ".join(differences) + "); "
            "resume with the same settings, or start a new run directory"
        )
