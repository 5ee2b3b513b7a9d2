"""Both sides of side_by_side.py (beside this file): our models in this process, the
reference's in its worker subprocess (`ref_worker.py`, the reference's own venv), and the parity
check of the two loadings.
"""

from __future__ import annotations

import gc
import json
import subprocess
from pathlib import Path

import torch

from dsbd.bench.decode.runners import Pair
from dsbd_core.models import load_causal_lm, prepare_preset

HERE = Path(__file__).resolve().parent


class RefWorker:
    """The reference worker subprocess: one JSON request per line, one JSON reply per line."""

    def __init__(self, python: str, ref_dir: str, target: Path, draft: Path, threads: int, log):
        cmd = [
            python,
            str(HERE / "ref_worker.py"),
            "--ref-dir",
            ref_dir,
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--threads",
            str(threads),
        ]
        # Same niceness as this process (inherited): both sides must compete for the CPU alike.
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1
        )
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"reference worker exited (rc={self.proc.poll()}); see its log")
        return json.loads(line)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@torch.no_grad()
def parity(theirs: dict, target, draft, ids: list[int]) -> dict:
    """Largest |log p| difference over each position's top-k, ours vs the reference's loading.

    `theirs` is the worker's answer to {"op": "logprobs", "ids": ids}.
    """
    report: dict = {"positions": len(ids)}
    for name, model in (("target", target), ("draft", draft)):
        ours = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        idx = torch.tensor(theirs[name]["indices"])
        diff = (ours.gather(1, idx) - torch.tensor(theirs[name]["values"])).abs().max().item()
        top1 = (ours.argmax(-1) == idx[:, 0]).float().mean().item()
        report[name] = {
            "max_abs_logprob_diff_topk": diff,
            "top1_agreement": top1,
            "k": idx.shape[1],
        }
    return report


class Sides:
    """Both sides' models: ours in this process, the reference in its worker.

    With `low_memory` only one side is loaded at a time (the Qwen pair in float32 needs ~9 GB
    per side): switching side unloads the other, and each load is followed by a warm-up.
    """

    def __init__(self, args, names: tuple[str, str], log_path: str) -> None:
        self.args, self.names, self.log_path = args, names, log_path
        self.warmup = lambda source: None  # set once the prompts are encoded
        self._pair: Pair | None = None
        self._worker: RefWorker | None = None
        self.hello: dict = {}
        self.loads = {"dsbd": 0, "reference": 0}

    def ours(self) -> Pair:
        if self.args.low_memory:
            self.close_reference()
        if self._pair is None:
            target, draft = (load_causal_lm(n) for n in self.names)
            self._pair = Pair(
                target, draft, torch.device("cpu"), (int(target.tokenizer.eos_token_id),)
            )
            self.loads["dsbd"] += 1
            self.warmup("dsbd")
        return self._pair

    def reference(self) -> RefWorker:
        if self.args.low_memory:
            self.drop_ours()
        if self._worker is None:
            with open(self.log_path, "a") as log:
                self._worker = RefWorker(
                    self.args.ref_python,
                    self.args.ref_dir,
                    *(prepare_preset(n) for n in self.names),
                    self.args.threads,
                    log,
                )
            self.hello = self._worker.hello
            self.loads["reference"] += 1
            self.warmup("reference")
        return self._worker

    def drop_ours(self) -> None:
        if self._pair is not None:
            self._pair = None
            gc.collect()

    def close_reference(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
