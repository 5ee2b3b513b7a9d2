"""Knowledge distillation of a draft model from a target: `dsbd distill`.

Two phases, both resumable:

1. **Teacher cache** (`build_cache`): the target's next-token distributions are computed ONCE
   and stored as top-k log-probabilities plus the remaining mass, so training epochs never pay
   the target's forward pass again. Training text is (a) continuations the target samples from
   training prompts (`dsbd_core.tools.prompts`: the text a decoder meets), and (b) chunks of local
   text
   (sources and READMEs of installed Python packages), teacher forced. The cache is a directory
   of shards (`sample-00000.pt`, `text-00000.pt`, ...) written atomically one by one; an
   interrupted build continues with the first missing shard, and asking for more samples later
   only adds shards. `heldout.json` keeps the held-out evaluation sequences (target samples on
   `prompts.EVAL_PROMPTS`, the same ones `dsbd eval-acceptance` scores). `meta.json` records
   every setting that changes the cached rows and the target's identity (`target_identity`),
   so a cache is never extended or trained on under other settings or for another target.

2. **Training** (`train`): the draft minimises KL(p || q) between the cached target
   distribution p (top-k tokens + one bucket for the rest) and the draft's q. Checkpoints hold
   the trainable weights, the optimizer, the RNG state and the step (the data order is a pure
   function of seed and epoch), so a resumed run is bit-identical to an uninterrupted one.
   Progress shows loss and held-out acceptance; a JSONL log records the learning curve.

Both phases run on the target's device (the caller moves it, e.g. `dsbd distill --device`);
the cache and the checkpoints are stored on the CPU, so either moves between machines. Bit-exact
resumption holds on the CPU; CUDA kernels may differ in round-off from run to run.

Draft architectures (`DraftSpec`):
- `cut`: the target's first `layers` decoder layers, final norm and (frozen, shared) embedding /
  head, then trained. Starts from the target's own features and its exact output space.
- `small`: a fresh narrow Llama (`hidden`, `layers`) with tied embeddings initialised from the
  top singular directions of the target's embedding matrix.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dsbd_core.tools.acceptance import (
    ScoredSequence,
    encode_prompt_for,
    measure_acceptance,
    model_device,
    next_token_probs,
    sample_prompt_continuations,
)
from dsbd_core.tools.acceptance import sample_continuations as _sample
from dsbd_core.tools.prompts import EVAL_PROMPTS, Prompt, training_prompts

# 2: `config` includes the sampling batch size and `target_identity` is recorded (format 1
# caches record neither, so they cannot be checked against the target and are refused).
CACHE_FORMAT = 2


# --- phase 1: the teacher cache ----------------------------------------------------------------


@dataclass
class CacheConfig:
    """What goes into a teacher cache. Fixed when the cache is created (see `meta.json`)."""

    top_k: int = 64
    new_tokens: int = 80  # sampled continuation length (training)
    heldout_tokens: int = 64  # held-out continuation length (= eval-acceptance's default)
    temperature: float = 1.0
    shard_size: int = 64  # sequences per shard
    batch_size: int = 16  # sampling batch (`dsbd distill --sample-batch`)
    text_len: int = 128  # tokens per local-text chunk
    seed: int = 0

    def fingerprint(self) -> dict:
        """Every field, the sampling batch size included: one generator feeds the batches in
        turn, one draw per row and step, so another batch size samples other tokens (and so
        caches other sequences), not just other round-off."""
        return asdict(self)


@dataclass
class CachePlan:
    """How much to cache: sampled sequences and local-text chunks (growable later)."""

    samples: int = 2048
    text_chunks: int = 256


def cache_meta(target, config: CacheConfig) -> dict:
    """`meta.json` of a cache for `target` (a `LoadedModel`): what must match to reuse it."""
    return {"format": CACHE_FORMAT, **_identity_fields(target), "config": config.fingerprint()}


# Config entries that say where or how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "use_cache", "dtype", "torch_dtype")
_SAMPLED_PER_TENSOR = 4096


def target_identity(model: torch.nn.Module) -> dict[str, str]:
    """What identifies a target for its teacher cache, whatever it was loaded from.

    The vocabulary size alone does not: a fine-tune, another size of the same family or a
    re-quantisation shares it while giving other distributions. `config` hashes the model's
    config (minus load-time entries); `weights` hashes every parameter's name, shape and an
    evenly strided sample of ~4k of its values, which any real change of the weights (training,
    merging, another quantisation) alters, at a cost of milliseconds instead of hashing
    gigabytes. Both are computed on the CPU, so they do not depend on the device.
    """
    config = {
        key: value
        for key, value in model.config.to_dict().items()
        if not key.startswith("_") and key not in _VOLATILE_CONFIG_KEYS
    }
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    weights = hashlib.sha256()
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLED_PER_TENSOR)].float().cpu().contiguous()
        weights.update(f"{name}:{tuple(param.shape)}:".encode())
        weights.update(sample.numpy().tobytes())
    return {"config": config_hash.hexdigest(), "weights": weights.hexdigest()}


def default_work_dir(target) -> Path:
    """`~/.cache/dsbd/distill/<target name>-<identity>`: readable, and keyed by the target's
    identity so two targets with the same base name (`a/model`, `b/model`) never share a cache,
    while the same target loaded from another path finds its cache again."""
    base = Path(target.name).name or "target"
    identity = target_identity(target.model)
    key = hashlib.sha256(f"{identity['config']}{identity['weights']}".encode()).hexdigest()
    return Path.home() / ".cache" / "dsbd" / "distill" / f"{base}-{key[:12]}"


def cache_differences(existing: dict, meta: dict) -> list[str]:
    """What differs between a cache's recorded `meta.json` and the one this run would write,
    each as `what: recorded -> now`; empty when the cache may be reused."""
    if existing.get("format") != meta["format"]:
        return [
            f"format: {existing.get('format')} -> {meta['format']} (a format-1 cache records "
            "neither the sampling batch size nor the target's identity)"
        ]
    differences = []
    recorded, current = existing.get("target_identity", {}), meta["target_identity"]
    for part in ("config", "weights"):
        if recorded.get(part) != current[part]:
            differences.append(
                f"target {part}: {str(recorded.get(part))[:12]}... (built for "
                f"{existing.get('target')!r}) -> {current[part][:12]}... ({meta['target']!r})"
            )
    if existing.get("vocab_size") != meta["vocab_size"]:
        differences.append(f"vocab_size: {existing.get('vocab_size')} -> {meta['vocab_size']}")
    old_config = existing.get("config", {})
    differences += [
        f"{key}: {old_config.get(key)} -> {value}"
        for key, value in meta["config"].items()
        if old_config.get(key) != value
    ]
    return differences


def build_cache(
    target,
    cache_dir: Path,
    config: CacheConfig,
    plan: CachePlan,
    *,
    prompts: Sequence[Prompt] | None = None,
    text_sources: Sequence[Path] | None = None,
    heldout_prompts: Sequence[Prompt] = EVAL_PROMPTS,
    progress: Callable[[str], None] = print,
) -> None:
    """Create or extend the teacher cache in `cache_dir` for `target` (a `LoadedModel`).

    `prompts` defaults to `prompts.training_prompts(seed)`; `text_sources` to the sources and
    READMEs of a few installed packages. Both are frozen into the cache when it is created
    (`prompts.jsonl`, `text.json`), so extending it later samples the same distribution.
    """
    from dsbd_core.models import stop_token_ids

    cache_dir.mkdir(parents=True, exist_ok=True)
    meta_path = cache_dir / "meta.json"
    meta = cache_meta(target, config)
    if meta_path.exists():
        differences = cache_differences(json.loads(meta_path.read_text()), meta)
        if differences:
            raise ValueError(
                f"{cache_dir} holds a teacher cache built with other settings ("
                + "; ".join(differences)
                + "); use another --work-dir, or the same target and settings"
            )
    else:
        _atomic_write_text(meta_path, json.dumps(meta, indent=2))

    prompts_path = cache_dir / "prompts.jsonl"
    if not prompts_path.exists():
        chosen = list(prompts) if prompts is not None else training_prompts(config.seed)
        _atomic_write_text(prompts_path, "\n".join(p.to_json() for p in chosen) + "\n")
    from dsbd_core.tools.prompts import load_prompts

    train_prompts = load_prompts(prompts_path)
    stops = stop_token_ids(target)
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else stops[0] if stops else 0

    heldout_path = cache_dir / "heldout.json"
    if not heldout_path.exists():
        progress(f"held-out set: sampling {len(heldout_prompts)} target continuations")
        sequences = sample_prompt_continuations(
            target, heldout_prompts, config.heldout_tokens, config.temperature, config.seed
        )
        _atomic_write_text(heldout_path, json.dumps([_sequence_json(s) for s in sequences]))

    shards = _shard_names(plan, config)
    text_chunks: list[list[int]] | None = None
    for index, name in enumerate(shards):
        path = cache_dir / f"{name}.pt"
        if path.exists():
            continue
        start = time.perf_counter()
        kind, number = name.split("-")
        number = int(number)
        if kind == "sample":
            shard = _sample_shard(target, train_prompts, number, config, stops, pad)
        else:
            if text_chunks is None:
                text_chunks = _text_chunks(target, cache_dir, config, plan, text_sources)
            shard = _text_shard(target, text_chunks, number, config)
        _atomic_save(shard, path)
        rows = shard["topk_ids"].shape[0]
        progress(
            f"shard {index + 1}/{len(shards)} {name}: {rows} positions in "
            f"{time.perf_counter() - start:.0f} s"
        )


def load_heldout(cache_dir: Path) -> list[ScoredSequence]:
    return [
        ScoredSequence(tuple(s["token_ids"]), s["start"], s["kind"])
        for s in json.loads((cache_dir / "heldout.json").read_text())
    ]


def _sequence_json(sequence: ScoredSequence) -> dict:
    return {"token_ids": list(sequence.token_ids), "start": sequence.start, "kind": sequence.kind}


def _shard_names(plan: CachePlan, config: CacheConfig) -> list[str]:
    """Shard build order: sample and text shards interleaved in proportion."""
    n_sample = math.ceil(plan.samples / config.shard_size)
    n_text = math.ceil(plan.text_chunks / config.shard_size)
    order = [(i / max(n_sample, 1), f"sample-{i:05d}") for i in range(n_sample)]
    order += [((i + 0.5) / max(n_text, 1), f"text-{i:05d}") for i in range(n_text)]
    return [name for _, name in sorted(order)]


def _topk_rows(logits: torch.Tensor, top_k: int, temperature: float) -> dict[str, torch.Tensor]:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    rest = (1.0 - values.double().exp().sum(-1)).clamp(min=0.0).float()
    # Stored on the CPU whatever the target's device (no-op moves there).
    return {"topk_ids": ids.int().cpu(), "topk_logp": values.half().cpu(), "rest": rest.cpu()}


def _pack(
    sequences: list[tuple[list[int], int]], rows: list[dict[str, torch.Tensor]], kinds: list[str]
):
    lengths = torch.tensor([len(ids) for ids, _ in sequences], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return {
        "tokens": torch.tensor([t for ids, _ in sequences for t in ids], dtype=torch.int32),
        "offsets": offsets,
        "starts": torch.tensor([start for _, start in sequences], dtype=torch.int32),
        "kinds": kinds,
        **{key: torch.cat([r[key] for r in rows]) for key in ("topk_ids", "topk_logp", "rest")},
    }


def _sample_shard(target, prompts: list[Prompt], number: int, config: CacheConfig, stops, pad):
    size = config.shard_size
    chosen = [prompts[(number * size + i) % len(prompts)] for i in range(size)]
    ids = [encode_prompt_for(target, p) for p in chosen]
    # Batch prompts of similar length together (less padding); the order is deterministic.
    order = sorted(range(size), key=lambda i: (len(ids[i]), i))
    sequences, logits = _sample(
        target.model,
        [ids[i] for i in order],
        new_tokens=config.new_tokens,
        temperature=config.temperature,
        seed=config.seed * 1_000_003 + number,
        stop_ids=stops,
        pad_id=pad,
        batch_size=config.batch_size,
        kinds=[chosen[i].kind for i in order],
        return_logits=True,
    )
    rows = [_topk_rows(lg, config.top_k, config.temperature) for lg in logits]
    return _pack(
        [(list(s.token_ids), s.start) for s in sequences], rows, [s.kind for s in sequences]
    )


@torch.inference_mode()
def _text_shard(target, chunks: list[list[int]], number: int, config: CacheConfig):
    size = config.shard_size
    chosen = chunks[number * size : (number + 1) * size]
    if not chosen:
        raise ValueError(f"text shard {number}: not enough local text chunks")
    sequences, rows = [], []
    for start in range(0, len(chosen), config.batch_size):
        batch = torch.tensor(chosen[start : start + config.batch_size])
        logits = target.model(batch.to(model_device(target.model))).logits[:, :-1]
        for row in range(batch.shape[0]):
            sequences.append((batch[row].tolist(), 1))
            rows.append(_topk_rows(logits[row], config.top_k, config.temperature))
    return _pack(sequences, rows, ["text"] * len(sequences))


def default_text_sources(packages: Sequence[str] = ("numpy", "pydantic", "pip", "transformers")):
    """Local text: package READMEs (dist-info METADATA, *.md / *.rst) and Python sources."""
    import sys

    sources: list[Path] = []
    for entry in sys.path:
        root = Path(entry)
        if not root.is_dir():
            continue
        sources += sorted(root.glob("*.dist-info/METADATA"))
        for package in packages:
            folder = root / package
            if (folder / "__init__.py").is_file():
                sources += sorted(folder.rglob("*.md")) + sorted(folder.rglob("*.rst"))
                sources += sorted(folder.rglob("*.py"))
    return sources


def _text_chunks(target, cache_dir: Path, config: CacheConfig, plan: CachePlan, sources):
    """`plan.text_chunks` token chunks of local text, chosen once and frozen in `text.json`."""
    path = cache_dir / "text.json"
    if path.exists():
        chunks = json.loads(path.read_text())
        if len(chunks) >= plan.text_chunks:
            return chunks
    files = list(sources) if sources is not None else default_text_sources()
    rng = random.Random(config.seed)
    rng.shuffle(files)
    chunks = []
    for file in files:
        if len(chunks) >= max(plan.text_chunks, 1):
            break
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = target.tokenizer.encode(text, add_special_tokens=False)
        # At most two chunks per file, from random places: many files, little repetition.
        spans = list(range(0, len(ids) - config.text_len + 1, config.text_len))
        for begin in rng.sample(spans, min(2, len(spans))):
            chunks.append(ids[begin : begin + config.text_len])
    _atomic_write_text(path, json.dumps(chunks))
    return chunks


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    tmp.replace(path)


# --- phase 2: training -------------------------------------------------------------------------


@dataclass
class DraftSpec:
    """The draft's architecture (see the module docstring)."""

    arch: str = "cut"  # "cut" | "small"
    layers: int = 4
    hidden: int = 256  # small only
    intermediate: int | None = None  # small only; default ~2.7 x hidden

    def __post_init__(self) -> None:
        if self.arch not in ("cut", "small"):
            raise ValueError(f"arch={self.arch!r}: allowed 'cut' or 'small'")
        if self.layers < 1:
            raise ValueError(f"layers={self.layers}: must be >= 1")


@dataclass
class TrainConfig:
    """Optimisation settings. `steps` fixes the learning-rate schedule (warm-up, cosine)."""

    steps: int = 4000
    batch_size: int = 16  # sequences per step
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    tv_weight: float = 0.0  # loss = KL(p||q) + tv_weight * TV(p, q) (top-k estimate)
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 25
    log_every: int = 5
    # Re-scan the cache for new shards at every epoch boundary (train while the cache grows).
    grow_data: bool = False

    def lr_at(self, step: int) -> float:
        """Linear warm-up over `warmup` steps, then cosine decay to `min_lr_ratio * lr`."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.lr * (
            self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        )


# Settings that may change between a run and its resumption: the first three do not alter the
# weights; a new `steps` re-plans the learning-rate schedule from the current step on (extend a
# run, or end it sooner with an annealed draft) and a new `tv_weight` changes the objective from
# the current step on. Resuming with the same settings is bit-exact.
_RESUMABLE_CHANGES = ("eval_every", "checkpoint_every", "log_every", "steps", "tv_weight")


def make_draft(target_model, spec: DraftSpec, seed: int):
    """A fresh draft for `target_model` (not modified) with `requires_grad` set for training."""
    import copy

    from transformers import AutoModelForCausalLM

    from dsbd_core.models import keep_first_layers

    if spec.arch == "cut":
        draft = keep_first_layers(copy.deepcopy(target_model), spec.layers)
        # The tied embedding/head stays the target's: frozen (and never stored in a delta).
        draft.get_input_embeddings().weight.requires_grad_(False)
        draft.get_output_embeddings().weight.requires_grad_(False)
    else:
        config = copy.deepcopy(target_model.config)
        heads = max(1, spec.hidden // 64)
        config.hidden_size = spec.hidden
        config.num_hidden_layers = spec.layers
        config.num_attention_heads = heads
        config.num_key_value_heads = heads
        config.head_dim = spec.hidden // heads
        config.intermediate_size = spec.intermediate or 64 * round(spec.hidden * 2.7 / 64)
        config.tie_word_embeddings = True
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[: spec.layers]
        torch.manual_seed(seed)
        draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # Initialised on the CPU (the SVD too), so the draft starts the same on every device.
        embedding = target_model.get_input_embeddings().weight.detach().float().cpu()
        u, s, _ = torch.linalg.svd(embedding, full_matrices=False)
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(u[:, : spec.hidden] * s[: spec.hidden])
        draft.tie_weights()
        draft.to(model_device(target_model))
    draft.config.use_cache = True
    return draft.train()


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class TeacherData:
    """The cached shards, as sequences with their cached target rows."""

    def __init__(self, cache_dir: Path, shard_names: Sequence[str] | None = None) -> None:
        if shard_names is None:
            shard_names = sorted(p.stem for p in cache_dir.glob("*.pt"))
        if not shard_names:
            raise ValueError(f"{cache_dir}: no cached shards; build the teacher cache first")
        self.shard_names = list(shard_names)
        self.shards = [torch.load(cache_dir / f"{n}.pt", weights_only=True) for n in shard_names]
        self.index: list[tuple[int, int, int]] = []  # (shard, sequence, first row)
        for s, shard in enumerate(self.shards):
            row = 0
            for q in range(len(shard["starts"])):
                self.index.append((s, q, row))
                length = int(shard["offsets"][q + 1] - shard["offsets"][q])
                row += length - int(shard["starts"][q])
        self.positions = sum(int(sh["topk_ids"].shape[0]) for sh in self.shards)

    def __len__(self) -> int:
        return len(self.index)

    def sequence(self, i: int):
        s, q, row = self.index[i]
        shard = self.shards[s]
        ids = shard["tokens"][shard["offsets"][q] : shard["offsets"][q + 1]].long()
        start = int(shard["starts"][q])
        rows = slice(row, row + len(ids) - start)
        return ids, start, shard["topk_ids"][rows], shard["topk_logp"][rows], shard["rest"][rows]

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        """The epoch's sequence order: a pure function of (seed, epoch)."""
        generator = torch.Generator().manual_seed(seed * 7919 + epoch)
        return torch.randperm(len(self), generator=generator)

    def batch(self, indices: Sequence[int], pad_id: int):
        """Right-padded ids, attention mask, (row, col) of each scored position, its targets."""
        items = [self.sequence(i) for i in indices]
        width = max(len(ids) for ids, *_ in items)
        ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        rows, cols = [], []
        for b, (seq, start, *_) in enumerate(items):
            ids[b, : len(seq)] = seq
            mask[b, : len(seq)] = 1
            # The prediction of token j is read at position j - 1.
            cols.append(torch.arange(start - 1, len(seq) - 1))
            rows.append(torch.full((len(seq) - start,), b))
        topk_ids = torch.cat([it[2] for it in items]).long()
        topk_logp = torch.cat([it[3] for it in items]).float()
        rest = torch.cat([it[4] for it in items]).float()
        return ids, mask, torch.cat(rows), torch.cat(cols), topk_ids, topk_logp, rest


def kd_loss(
    logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logp: torch.Tensor,
    rest: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(p || q) and TV(p, q) on the coarsening {top-k tokens, everything else}.

    p: the target's top-k probabilities and its remaining mass `rest` (renormalised to sum to
    one against fp16 round-off); q: softmax(logits / temperature) over the full vocabulary,
    its mass outside the target's top-k lumped into one bucket. On that coarsening KL and TV are
    lower bounds of the full ones, and equal them when the target's tail is empty.
    """
    logq = torch.log_softmax(logits.float() / temperature, dim=-1)
    logq_top = logq.gather(-1, topk_ids)
    masked = logq.scatter(-1, topk_ids, float("-inf"))
    logq_rest = torch.logsumexp(masked, dim=-1)
    p_top = topk_logp.exp()
    total = p_top.sum(-1) + rest
    p_top = p_top / total[:, None]
    p_rest = rest / total
    logp_top = torch.log(p_top.clamp(min=1e-30))
    kl = (p_top * (logp_top - logq_top)).sum(-1) + torch.where(
        p_rest > 0, p_rest * (torch.log(p_rest.clamp(min=1e-30)) - logq_rest), 0.0
    )
    tv = 0.5 * ((p_top - logq_top.exp()).abs().sum(-1) + (p_rest - logq_rest.exp()).abs())
    return kl, tv


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
    from tqdm.auto import tqdm

    call_start = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    out_dir = out_dir or run_dir / "draft"
    state_path = run_dir / "state.pt"
    log_path = run_dir / "log.jsonl"
    meta = json.loads((cache_dir / "meta.json").read_text())
    # The cut draft starts from this target and learns its cached distributions: both must be
    # the cache's target (the format is checked first: a format-1 cache records no identity).
    now = {**meta, **_identity_fields(target), "format": CACHE_FORMAT}
    differences = cache_differences(meta, now)
    if differences:
        raise ValueError(
            f"{cache_dir}: the teacher cache does not fit this target ("
            + "; ".join(differences)
            + "); train with the target it was built for, or build a cache for this one "
            "(another --work-dir)"
        )
    cache_temperature = meta["config"]["temperature"]
    device = model_device(target.model)
    settings = {"spec": asdict(spec), "train": asdict(config), "cache": meta}

    # Checkpoints are read onto the CPU (they may come from another device); the weights and the
    # optimizer state are copied to the draft's device below.
    state = (
        torch.load(state_path, map_location="cpu", weights_only=False)
        if state_path.exists()
        else None
    )
    if state is not None:
        _check_resumable(state["settings"], settings)
        saved = state["settings"]["train"]
        if (saved["steps"], saved["tv_weight"]) != (config.steps, config.tv_weight):
            change = {"steps": config.steps, "lr": config.lr, "tv_weight": config.tv_weight}
            _append_jsonl(log_path, {"step": state["step"], "schedule": change})
        data = TeacherData(cache_dir, state["shards"])
    else:
        data = TeacherData(cache_dir)
    draft = make_draft(target.model, spec, config.seed)
    params = [p for p in draft.parameters() if p.requires_grad]
    names = [n for n, p in draft.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98)
    )
    history: list[dict] = []
    elapsed = 0.0
    step = 0
    if state is not None:
        with torch.no_grad():
            for name, param in zip(names, params, strict=True):
                param.copy_(state["trainable"][name])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step, elapsed, history = state["step"], state["elapsed_s"], state["history"]
        epoch, epoch_start = state["epoch"], state["epoch_start"]
    else:
        epoch, epoch_start = 0, 0
        torch.manual_seed(config.seed)

    heldout = load_heldout(cache_dir) if (cache_dir / "heldout.json").exists() else []
    heldout_probs: list[torch.Tensor] = []  # the target's, computed at the first evaluation
    pad = target.tokenizer.pad_token_id or 0
    say = log or (lambda message: None)

    def describe() -> int:
        per_epoch = len(data) // config.batch_size
        if per_epoch == 0:
            raise ValueError(f"{len(data)} cached sequences < batch size {config.batch_size}")
        say(
            f"epoch {epoch}: data {len(data)} sequences / {data.positions} positions in "
            f"{len(data.shard_names)} shards; {per_epoch} steps per epoch"
        )
        return per_epoch

    say(
        f"draft {spec.arch} {spec.layers} layers: {sum(p.numel() for p in params) / 1e6:.2f}M "
        f"trainable of {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters; "
        f"{'resuming at' if step else 'starting from'} step {step}"
    )
    per_epoch = describe()

    def evaluate() -> dict:
        if not heldout_probs:
            heldout_probs.extend(
                next_token_probs(target.model, s, cache_temperature).half() for s in heldout
            )
        draft.eval()
        report = measure_acceptance(
            target.model,
            draft,
            heldout,
            temperature=cache_temperature,
            target_probs=heldout_probs,
        )
        draft.train()
        return report.as_dict()

    def checkpoint() -> None:
        _atomic_save(
            {
                "settings": settings,
                "shards": data.shard_names,
                "step": step,
                "epoch": epoch,
                "epoch_start": epoch_start,
                "elapsed_s": elapsed,
                "trainable": dict(zip(names, (p.detach().cpu() for p in params), strict=True)),
                "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "history": history,
            },
            state_path,
        )

    if step == 0 and heldout and not history:
        record = {"step": 0, "elapsed_s": 0.0, "heldout": evaluate()}
        history.append(record)
        _append_jsonl(log_path, record)
    bar = tqdm(
        total=config.steps,
        initial=step,
        disable=not progress_bar,
        dynamic_ncols=True,
        desc="distill",
        unit="step",
    )
    last_acc = history[-1]["heldout"]["overall"]["acceptance"] if history else float("nan")
    this_run = 0
    # What a call that trains no step (the checkpoint already reached `steps`) reports.
    status: dict = {"step": step, "epoch": epoch, "elapsed_s": round(elapsed, 2)}
    if history and history[-1]["step"] == step:
        status["heldout"] = history[-1]["heldout"]
    smooth = None
    order = data.order(config.seed, epoch)
    while step < config.steps:
        within = step - epoch_start
        if within >= per_epoch:
            epoch, epoch_start, within = epoch + 1, step, 0
            if config.grow_data:
                found = sorted(p.stem for p in cache_dir.glob("*.pt"))
                if found != data.shard_names:
                    data = TeacherData(cache_dir, found)
            per_epoch = describe()
            order = data.order(config.seed, epoch)
        indices = order[within * config.batch_size : (within + 1) * config.batch_size].tolist()
        started = time.perf_counter()
        ids, mask, rows, cols, topk_ids, topk_logp, rest = (
            tensor.to(device) for tensor in data.batch(indices, pad)
        )
        lr = config.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = draft.lm_head(hidden[rows, cols])
        kl, tv = kd_loss(logits, topk_ids, topk_logp, rest, cache_temperature)
        loss = kl.mean() + config.tv_weight * tv.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        step += 1
        this_run += 1
        elapsed += time.perf_counter() - started
        value = loss.item()
        smooth = value if smooth is None else 0.95 * smooth + 0.05 * value
        status = {
            "step": step,
            "epoch": epoch,
            "elapsed_s": round(elapsed, 2),
            "lr": lr,
            "loss": value,
            "kl": kl.mean().item(),
            "train_acceptance_topk": 1 - tv.mean().item(),
            "positions": int(rows.numel()),
        }
        if step % config.log_every == 0:
            _append_jsonl(log_path, status)
        if heldout and (step % config.eval_every == 0 or step == config.steps):
            status["heldout"] = evaluate()
            last_acc = status["heldout"]["overall"]["acceptance"]
            history.append({"step": step, "elapsed_s": elapsed, "heldout": status["heldout"]})
            _append_jsonl(
                log_path, {"step": step, "elapsed_s": elapsed, "heldout": status["heldout"]}
            )
            say(f"step {step}: held-out acceptance {last_acc:.4f}")
        bar.set_postfix(loss=f"{smooth:.3f}", acc=f"{last_acc:.3f}", refresh=False)
        bar.update(1)
        stopping = (stop_after is not None and this_run >= stop_after) or (
            time_limit_s is not None and time.perf_counter() - call_start > time_limit_s
        )
        if step % config.checkpoint_every == 0 or step == config.steps or stopping:
            checkpoint()
        if stopping:
            break
    bar.close()
    save_draft(draft, target.tokenizer, out_dir)
    status["finished"] = step >= config.steps
    status["already_finished"] = status["finished"] and this_run == 0
    status["out"] = str(out_dir)
    return status


def export_checkpoint(target, run_dir: Path, out_dir: Path) -> dict:
    """Write the draft of a run's latest checkpoint (`run_dir/state.pt`) to `out_dir`, without
    training: a snapshot of a run still going. Returns the checkpoint's step and last held-out
    figures."""
    state = torch.load(run_dir / "state.pt", map_location="cpu", weights_only=False)
    spec = DraftSpec(**state["settings"]["spec"])
    draft = make_draft(target.model, spec, state["settings"]["train"]["seed"])
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if param.requires_grad:
                param.copy_(state["trainable"][name])
    save_draft(draft, target.tokenizer, out_dir)
    last = state["history"][-1] if state["history"] else {}
    return {"step": state["step"], "elapsed_s": state["elapsed_s"], "last_eval": last}


def save_draft(draft, tokenizer, out_dir: Path) -> None:
    """Write the draft as a standard transformers directory (config, safetensors, tokenizer)."""
    import copy

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model = copy.deepcopy(draft).eval().cpu()
        for param in model.parameters():
            param.requires_grad_(False)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _identity_fields(target) -> dict:
    """The `meta.json` fields that identify `target` (see `cache_meta`)."""
    return {
        "target": target.name,
        "target_identity": target_identity(target.model),
        "vocab_size": target.vocab_size,
    }


def _check_resumable(saved: dict, current: dict) -> None:
    """Refuse to resume a checkpoint under settings that would change the result."""
    saved_train = {k: v for k, v in saved["train"].items() if k not in _RESUMABLE_CHANGES}
    current_train = {k: v for k, v in current["train"].items() if k not in _RESUMABLE_CHANGES}
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


def _append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
