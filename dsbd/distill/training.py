"""Phase 2, training (`train`): the draft minimises KL(p || q) on the teacher cache.

p is the cached target distribution (top-k tokens + one bucket for the rest, `loss.kd_loss`),
q the draft's. Checkpoints (`checkpoint`) make a resumed run bit-identical to an uninterrupted
one. Progress shows loss and held-out acceptance (`progress`, `evaluation`); a JSONL log
(`run_dir/log.jsonl`) records the learning curve.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from dsbd.acceptance import model_device
from dsbd.distill.checkpoint import (
    RunState,
    Trainee,
    check_resumable,
    read_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from dsbd.distill.config import TrainConfig
from dsbd.distill.data import TeacherData, find_shards
from dsbd.distill.draft import DraftSpec
from dsbd.distill.evaluation import HeldoutEvaluator
from dsbd.distill.export import save_draft
from dsbd.distill.files import append_jsonl
from dsbd.distill.identity import cache_meta_for_training
from dsbd.distill.loss import kd_loss
from dsbd.distill.progress import TrainingBar


def train(
    target,
    cache_dir: Path,
    run_dir: Path,
    spec: DraftSpec,
    config: TrainConfig,
    *,
    out_dir: Path | None = None,
    stop_after: int | None = None,
    time_limit_s: float | None = None,
    progress_bar: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Train (or resume training) a draft for `target` (a `LoadedModel`) on the teacher cache.

    `run_dir/state.pt` is the checkpoint: when it exists the run resumes from it, bit-exactly
    (same weights as a run never interrupted). `stop_after` / `time_limit_s` end this call early
    (after a checkpoint) without changing the schedule. Returns the last status record (with
    `already_finished` when the checkpoint had reached `config.steps` before this call); writes
    the draft as a transformers directory to `out_dir` (default `run_dir/draft`) at the end,
    also when there was nothing left to train. Runs on the target model's device.
    """
    call_start = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    out_dir = out_dir or run_dir / "draft"
    meta = cache_meta_for_training(target, cache_dir)
    cache_temperature = meta["config"]["temperature"]
    settings = {"spec": asdict(spec), "train": asdict(config), "cache": meta}
    data, trainee, run = _start_or_resume(target, cache_dir, run_dir, spec, config, settings)
    say = log or (lambda message: None)
    session = _TrainingCall(
        target, cache_dir, run_dir, config, settings, data, trainee, run, cache_temperature, say
    )
    session.describe_draft(spec)
    session.describe_epoch()
    session.evaluate_start()
    history = run.history
    last_acc = history[-1]["heldout"]["overall"]["acceptance"] if history else float("nan")
    bar = TrainingBar(config.steps, run.step, progress_bar, last_acc)

    def stopping(this_run: int) -> bool:
        """Whether this call ends now (`stop_after` steps trained, or `time_limit_s` spent)."""
        return (stop_after is not None and this_run >= stop_after) or (
            time_limit_s is not None and time.perf_counter() - call_start > time_limit_s
        )

    status, this_run = _train_steps(session, bar, stopping)
    bar.close()
    save_draft(trainee.draft, target.tokenizer, out_dir)
    status["finished"] = run.step >= config.steps
    status["already_finished"] = status["finished"] and this_run == 0
    status["out"] = str(out_dir)
    return status


def _start_or_resume(
    target, cache_dir: Path, run_dir: Path, spec: DraftSpec, config: TrainConfig, settings: dict
) -> tuple[TeacherData, Trainee, RunState]:
    """The data, the draft with its optimizer, and where the run stands: from the checkpoint
    `run_dir/state.pt` when there is one (refused under settings that would change the result;
    an allowed schedule change is logged), else a fresh start seeded with `config.seed`."""
    state_path = run_dir / "state.pt"
    state = read_checkpoint(state_path) if state_path.exists() else None
    if state is not None:
        check_resumable(state["settings"], settings)
        saved = state["settings"]["train"]
        if (saved["steps"], saved["tv_weight"]) != (config.steps, config.tv_weight):
            change = {"steps": config.steps, "lr": config.lr, "tv_weight": config.tv_weight}
            append_jsonl(run_dir / "log.jsonl", {"step": state["step"], "schedule": change})
        data = TeacherData(cache_dir, state["shards"])
    else:
        data = TeacherData(cache_dir)
    trainee = Trainee.create(target.model, spec, config)
    if state is not None:
        return data, trainee, restore_checkpoint(state, trainee)
    torch.manual_seed(config.seed)
    return data, trainee, RunState()


def _train_steps(
    session: _TrainingCall, bar: TrainingBar, stopping: Callable[[int], bool]
) -> tuple[dict, int]:
    """Train until `config.steps` or until `stopping(steps trained by this call)`, checkpointing
    every `checkpoint_every` steps, at the end and when stopping. Returns the last status record
    and the number of steps this call trained."""
    config, run = session.config, session.run
    this_run = 0
    status = session.initial_status()
    order = session.data.order(config.seed, run.epoch)
    while run.step < config.steps:
        within = run.step - run.epoch_start
        if within >= session.per_epoch:
            session.next_epoch()
            within = 0
            order = session.data.order(config.seed, run.epoch)
        indices = order[within * config.batch_size : (within + 1) * config.batch_size].tolist()
        status = session.step(indices)
        this_run += 1
        acceptance = session.record(status)
        bar.step(status["loss"], acceptance)
        stop = stopping(this_run)
        if run.step % config.checkpoint_every == 0 or run.step == config.steps or stop:
            session.checkpoint()
        if stop:
            break
    return status, this_run


class _TrainingCall:
    """One call of `train`: the run's data, draft and state, and what a step, an epoch
    boundary, an evaluation and a checkpoint need of them."""

    def __init__(
        self,
        target,
        cache_dir: Path,
        run_dir: Path,
        config: TrainConfig,
        settings: dict,
        data: TeacherData,
        trainee: Trainee,
        run: RunState,
        temperature: float,
        say: Callable[[str], None],
    ) -> None:
        self.cache_dir = cache_dir
        self.state_path = run_dir / "state.pt"
        self.log_path = run_dir / "log.jsonl"
        self.config = config
        self.settings = settings
        self.data = data
        self.trainee = trainee
        self.run = run
        self.temperature = temperature  # the cache's: the draft learns p at that temperature
        self.device = model_device(target.model)
        self.evaluate = HeldoutEvaluator(target.model, cache_dir, temperature)
        self.pad = target.tokenizer.pad_token_id or 0
        self.say = say
        self.per_epoch = 0

    def describe_draft(self, spec: DraftSpec) -> None:
        """Report the draft's size and whether the run starts or resumes."""
        params, draft, step = self.trainee.params, self.trainee.draft, self.run.step
        self.say(
            f"draft {spec.arch} {spec.layers} layers: {sum(p.numel() for p in params) / 1e6:.2f}M "
            f"trainable of {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters; "
            f"{'resuming at' if step else 'starting from'} step {step}"
        )

    def describe_epoch(self) -> None:
        """Set `per_epoch` (whole batches of the current data) and report the epoch's data."""
        data, batch_size = self.data, self.config.batch_size
        self.per_epoch = len(data) // batch_size
        if self.per_epoch == 0:
            raise ValueError(f"{len(data)} cached sequences < batch size {batch_size}")
        self.say(
            f"epoch {self.run.epoch}: data {len(data)} sequences / {data.positions} positions in "
            f"{len(data.shard_names)} shards; {self.per_epoch} steps per epoch"
        )

    def next_epoch(self) -> None:
        """Begin the next epoch at the current step; with `grow_data`, on the shards the cache
        holds now (new ones join only at an epoch boundary, so the order stays a pure function
        of seed and epoch, and the checkpoint records the shards)."""
        self.run.epoch, self.run.epoch_start = self.run.epoch + 1, self.run.step
        if self.config.grow_data:
            found = find_shards(self.cache_dir)
            if found != self.data.shard_names:
                self.data = TeacherData(self.cache_dir, found)
        self.describe_epoch()

    def step(self, indices: list[int]) -> dict:
        """One optimisation step on the sequences `indices`; returns its status record."""
        config, run, trainee = self.config, self.run, self.trainee
        started = time.perf_counter()
        ids, mask, rows, cols, topk_ids, topk_logp, rest = (
            tensor.to(self.device) for tensor in self.data.batch(indices, self.pad)
        )
        lr = config.lr_at(run.step)
        for group in trainee.optimizer.param_groups:
            group["lr"] = lr
        hidden = trainee.draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = trainee.draft.lm_head(hidden[rows, cols])
        kl, tv = kd_loss(logits, topk_ids, topk_logp, rest, self.temperature)
        loss = kl.mean() + config.tv_weight * tv.mean()
        trainee.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trainee.params, config.grad_clip)
        trainee.optimizer.step()
        run.step += 1
        run.elapsed += time.perf_counter() - started
        return {
            "step": run.step,
            "epoch": run.epoch,
            "elapsed_s": round(run.elapsed, 2),
            "lr": lr,
            "loss": loss.item(),
            "kl": kl.mean().item(),
            "train_acceptance_topk": 1 - tv.mean().item(),
            "positions": int(rows.numel()),
        }

    def record(self, status: dict) -> float | None:
        """Log the step's `status` (every `log_every` steps) and evaluate the draft (every
        `eval_every` steps and at the last); returns the held-out acceptance when evaluated."""
        config, step = self.config, self.run.step
        if step % config.log_every == 0:
            append_jsonl(self.log_path, status)
        if not (self.evaluate and (step % config.eval_every == 0 or step == config.steps)):
            return None
        status["heldout"] = self.evaluate(self.trainee.draft)
        acceptance = status["heldout"]["overall"]["acceptance"]
        self._add_evaluation(
            {"step": step, "elapsed_s": self.run.elapsed, "heldout": status["heldout"]}
        )
        self.say(f"step {step}: held-out acceptance {acceptance:.4f}")
        return acceptance

    def evaluate_start(self) -> None:
        """Evaluate the untrained draft (step 0) once per run: the curve's first point."""
        if self.run.step == 0 and self.evaluate and not self.run.history:
            heldout = self.evaluate(self.trainee.draft)
            self._add_evaluation({"step": 0, "elapsed_s": 0.0, "heldout": heldout})

    def _add_evaluation(self, record: dict) -> None:
        """A point of the learning curve: kept in the checkpoint's history and logged."""
        self.run.history.append(record)
        append_jsonl(self.log_path, record)

    def initial_status(self) -> dict:
        """What a call that trains no step (the checkpoint already reached `steps`) reports."""
        run = self.run
        status: dict = {"step": run.step, "epoch": run.epoch, "elapsed_s": round(run.elapsed, 2)}
        if run.history and run.history[-1]["step"] == run.step:
            status["heldout"] = run.history[-1]["heldout"]
        return status

    def checkpoint(self) -> None:
        """Save the run's state now (see `checkpoint.save_checkpoint`)."""
        save_checkpoint(self.state_path, self.settings, self.data, self.run, self.trainee)
