"""Knowledge distillation of a draft model from a target: `dsbd distill`.

Two phases, both resumable:

1. **Teacher cache** (`build_cache`, in `cache`): the target's next-token distributions are
   computed ONCE and stored as top-k log-probabilities plus the remaining mass, so training
   epochs never pay the target's forward pass again. Training text is (a) continuations the
   target samples from training prompts (`dsbd.prompts`: the text a decoder meets),
   and (b) chunks of local text (sources and READMEs of installed Python packages, `text`),
   teacher forced. The cache is a directory of shards (`sample-00000.pt`, `text-00000.pt`,
   ...) written atomically one by one; an interrupted build continues with the first missing
   shard, and asking for more samples later only adds shards. `heldout.json` keeps the
   held-out evaluation sequences (target samples on `prompts.EVAL_PROMPTS`, the same ones
   `dsbd eval-acceptance` scores). `meta.json` records every setting that changes the cached
   rows and the target's identity (`target_identity`, in `identity`), so a cache is never
   extended or trained on under other settings or for another target.

2. **Training** (`train`, in `training`): the draft minimises KL(p || q) between the cached
   target distribution p (top-k tokens + one bucket for the rest) and the draft's q (`loss`).
   Checkpoints (`checkpoint`) hold the trainable weights, the optimizer, the RNG state and the
   step (the data order is a pure function of seed and epoch, `data`), so a resumed run is
   bit-identical to an uninterrupted one. Progress shows loss and held-out acceptance
   (`progress`, `evaluation`); a JSONL log records the learning curve.

Both phases run on the target's device (the caller moves it, e.g. `dsbd distill --device`);
the cache and the checkpoints are stored on the CPU, so either moves between machines. Bit-exact
resumption holds on the CPU; CUDA kernels may differ in round-off from run to run.

Draft architectures (`DraftSpec`, in `draft`):
- `cut`: the target's first `layers` decoder layers, final norm and (frozen, shared) embedding /
  head, then trained. Starts from the target's own features and its exact output space.
- `small`: a fresh narrow Llama (`hidden`, `layers`) with tied embeddings initialised from the
  top singular directions of the target's embedding matrix.

The trained draft is written as a standard transformers directory (`export`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsbd_core.algorithm.lazy_names import lazy_names

if TYPE_CHECKING:
    from dsbd.distill.cache import build_cache, load_heldout
    from dsbd.distill.config import DraftSpec, TrainConfig
    from dsbd.distill.data import TeacherData
    from dsbd.distill.draft import make_draft, trainable_state
    from dsbd.distill.export import export_checkpoint, save_draft
    from dsbd.distill.identity import (
        CACHE_FORMAT,
        CacheConfig,
        CachePlan,
        cache_differences,
        cache_meta,
        default_work_dir,
        target_identity,
    )
    from dsbd.distill.loss import kd_loss
    from dsbd.distill.text import default_text_sources
    from dsbd.distill.training import train

# name -> the module of this package that defines it, imported on first use
_EXPORTS = {
    "build_cache": "cache",
    "load_heldout": "cache",
    "TrainConfig": "config",
    "DraftSpec": "config",
    "TeacherData": "data",
    "make_draft": "draft",
    "trainable_state": "draft",
    "export_checkpoint": "export",
    "save_draft": "export",
    "CACHE_FORMAT": "identity",
    "CacheConfig": "identity",
    "CachePlan": "identity",
    "cache_differences": "identity",
    "cache_meta": "identity",
    "default_work_dir": "identity",
    "target_identity": "identity",
    "kd_loss": "loss",
    "default_text_sources": "text",
    "train": "training",
}

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals())

__all__ = [
    "CACHE_FORMAT",
    "CacheConfig",
    "CachePlan",
    "DraftSpec",
    "TeacherData",
    "TrainConfig",
    "build_cache",
    "cache_differences",
    "cache_meta",
    "default_text_sources",
    "default_work_dir",
    "export_checkpoint",
    "kd_loss",
    "load_heldout",
    "make_draft",
    "save_draft",
    "target_identity",
    "train",
    "trainable_state",
]
