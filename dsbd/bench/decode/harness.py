"""The run loop: load the pair, warm up, decode every prompt with every method, checkpoint.

Order: for prompt i, every method once, starting at method i mod M (a rotation, so no method is
always first or last after a model switch); then prompt i + 1. Each finished decode is appended
to records.jsonl at once, so a killed run loses at most one decode, and rerunning the same
command resumes (the config must match run.json except for the number of prompts, which may
grow; `fresh=True` starts over).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from dsbd.bench.decode.humaneval import (
    SandboxMode,
    check_completion,
    default_sandbox,
    truncate_completion,
)
from dsbd.bench.decode.measure import EnergyMeter, measured
from dsbd.bench.decode.methods import MethodSpec, parse_methods
from dsbd.bench.decode.quality import answer_log_likelihood
from dsbd.bench.decode.report import summarize, write_outputs
from dsbd.bench.decode.runners import (
    Pair,
    hf_generation_config,
    probe_assisted_beams,
    run_engine,
    run_hf,
)
from dsbd.bench.decode.schema import BenchConfig, BenchResult, MethodRecord
from dsbd.prompts import BenchPrompt, prompt_set
from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.scorers.ngram_bounds import describe_lookup

# Our methods on the static path keep their KV cache in a preallocated pool, not in forward
# outputs: the KV peak column covers transformers' methods and the dynamic path only.
STATIC_KV_NOTE = (
    "static decode path: target KV peak not measured for our methods (their KV "
    "lives in a preallocated pool; its size: `dsbd generate`, /v1/dsbd/status)"
)


class ResumeMismatchError(ValueError):
    """The output directory holds a run with another config."""


def run_bench(
    config: BenchConfig,
    out_dir: Path,
    *,
    fresh: bool = False,
    progress: bool = True,
    extra_records: list[MethodRecord] | None = None,
    say: Callable[[str], None] = print,
    recalibrate: bool = False,
) -> BenchResult:
    """Run (or resume) a benchmark and write its outputs into `out_dir`."""
    from dsbd_core.models import encode_prompt
    from dsbd_core.models.options import DraftOptions
    from dsbd_core.models.pair import load_pair

    load_at_start = os.getloadavg()  # a quiet machine is part of the result (before and after)
    specs = parse_methods(",".join(config.methods), gamma=config.gamma)
    prompts = prompt_set(config.prompt_set)[: config.prompts]
    records = _open_run(config, out_dir, fresh)
    torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    say(f"loading target {config.target} and draft {config.draft} ...")
    draft_name = config.draft if config.draft and any(s.uses_draft_model for s in specs) else None
    options = DraftOptions(
        quantize=config.draft_quantize,
        head_tokens=config.draft_head_tokens,
        ngram_max=config.ngram_max,
    )
    loaded = load_pair(
        config.target,
        draft_name,
        dtype=config.dtype,
        device=str(device),
        draft_options=options,
        decode_path=config.decode_path,
    )
    say(loaded.describe())
    calibration = lookup_calibration = None
    adaptive = [s for s in specs if s.uses_draft and not s.fixed_knobs]
    if loaded.draft is not None and any(not s.lookup for s in adaptive):
        calibration = loaded.calibration(force=recalibrate, say=say)
    if any(s.lookup for s in adaptive):  # the same target with the prompt-lookup draft
        lookup = dataclasses.replace(
            loaded,
            draft=None,
            lookup=config.ngram_max,
            draft_variant=describe_lookup(config.ngram_max),
        )
        lookup_calibration = lookup.calibration(force=recalibrate, say=say)
    pair = Pair(
        loaded.target,
        loaded.draft,
        device,
        loaded.stop_ids,
        calibration,
        decode_path=loaded.decode_path,
        ngram_max=config.ngram_max,
        lookup_calibration=lookup_calibration,
    )
    prompt_ids = [encode_prompt(loaded.target, p.text, chat=p.chat) for p in prompts]
    _write_prompts(out_dir / "prompts.jsonl", prompts, prompt_ids)
    energy = EnergyMeter(device)
    # a str in the schema, one of `dsbd bench --sandbox`'s choices
    sandbox = cast("SandboxMode | None", config.sandbox) or default_sandbox()

    def base_config(index: int, max_new_tokens: int | None = None) -> SamplingConfig:
        return SamplingConfig(
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            gamma=config.gamma,
            max_new_tokens=max_new_tokens or config.max_new_tokens,
            seed=config.seed + index,
            eos_token_ids=pair.stop_ids,
        )

    probe = (
        probe_assisted_beams(pair, prompt_ids[0], base_config(0))
        if pair.draft is not None and any(not s.engine for s in specs)
        else {"skipped": "no transformers baseline with a draft in this run"}
    )
    done = {(r.prompt_id, r.method) for r in records}
    if config.warmup_tokens > 0 and len(done) < len(prompts) * len(specs):
        say(f"warm-up: every method once, {config.warmup_tokens} tokens (not recorded)")
        for spec in specs:
            _decode(spec, pair, prompt_ids[0], base_config(0, config.warmup_tokens), 0)
    total = len(prompts) * len(specs)
    bar = _progress(total, len(done), progress)
    for index, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
        shift = index % len(specs)
        ordered = [
            (order, spec)
            for order, spec in enumerate(specs[shift:] + specs[:shift])
            if (prompt.id, spec.name) not in done
        ]
        measured_here = []
        for order, spec in ordered:
            bar.set_description(f"{prompt.id} {spec.name}")
            measured_here.append(
                _measure_one(
                    spec,
                    pair,
                    prompt,
                    ids,
                    base_config(index),
                    config,
                    index,
                    order,
                    energy,
                    sandbox,
                )
            )
            bar.update(1)
        rounds = [[r.seconds] for r in measured_here]
        for _ in range(config.timing_rounds - 1):  # the same decodes again, interleaved alike
            for (_, spec), seconds in zip(ordered, rounds, strict=True):
                seconds.append(
                    _time_again(spec, pair, ids, base_config(index), config, index, energy)
                )
        for record, seconds in zip(measured_here, rounds, strict=True):
            if config.timing_rounds > 1:
                record.round_seconds = seconds
                record.seconds = statistics.median(seconds)
            records.append(record)
            with (out_dir / "records.jsonl").open("a") as stream:
                stream.write(record.model_dump_json() + "\n")
    bar.close()
    all_records = records + list(extra_records or [])
    result = BenchResult(
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=sys.argv,
        config=config,
        machine={**machine_info(device), "load_average_start": load_at_start},
        versions=versions(),
        git=git_info(),
        prompts=[
            {**p.to_dict(), "prompt_ids": ids} for p, ids in zip(prompts, prompt_ids, strict=True)
        ],
        transformers_settings=_hf_settings(specs, pair, base_config(0)),
        transformers_assisted_with_beams=probe,
        energy_note=energy.reason or "NVML total-energy counter of the GPU",
        notes=[f"models: {loaded.describe()}"]
        + ([STATIC_KV_NOTE] if loaded.decode_path == "static" else [])
        + ([f"HumanEval sandbox: {sandbox}"] if any(p.task_id for p in prompts) else []),
        summary=summarize(all_records),
        records=all_records,
    )
    write_outputs(result, out_dir)
    return result


def rebuild_report(out_dir: Path, extra_records: list[MethodRecord] | None = None) -> BenchResult:
    """Rebuild results.json, table.md and plots from records.jsonl (+ another harness's).

    Metadata (machine, versions, probe) is kept from results.json when the run finished; for a
    partial run it is filled in now and the notes say so.
    """
    config = BenchConfig.model_validate_json((out_dir / "run.json").read_text())
    records = read_records(out_dir / "records.jsonl") + list(extra_records or [])
    if (out_dir / "results.json").is_file():
        previous = BenchResult.model_validate_json((out_dir / "results.json").read_text())
        previous_ours = [r for r in previous.records if r.source == "dsbd"]
        base = previous.model_copy(update={"records": previous_ours})
    else:
        base = BenchResult(
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            command=sys.argv,
            config=config,
            machine=machine_info(torch.device(config.device)),
            versions=versions(),
            git=git_info(),
            prompts=_read_jsonl(out_dir / "prompts.jsonl"),
            transformers_settings={},
            transformers_assisted_with_beams={},
            energy_note="not recorded (report rebuilt from a partial run)",
            notes=["report rebuilt from records.jsonl of a run that had not finished"],
            summary={},
            records=[],
        )
    result = base.model_copy(update={"summary": summarize(records), "records": records})
    write_outputs(result, out_dir)
    return result


def read_records(path: Path) -> list[MethodRecord]:
    """MethodRecords of a JSONL file (records.jsonl, or another harness's)."""
    return [MethodRecord.model_validate(row) for row in _read_jsonl(path)]


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _decode(spec: MethodSpec, pair: Pair, ids: list[int], base: SamplingConfig, seed: int):
    if spec.engine:
        return run_engine(spec, pair, ids, base)
    return run_hf(spec, pair, ids, base, seed)


def _time_again(
    spec: MethodSpec,
    pair: Pair,
    ids: list[int],
    base: SamplingConfig,
    config: BenchConfig,
    index: int,
    energy: EnergyMeter,
) -> float:
    """Wall seconds of one more decode of a measured prompt (the same seed: the same tokens),
    timed as the first was."""
    with measured(pair.device, energy) as cost:
        _decode(spec, pair, ids, base, config.seed + index)
    return cost.seconds


def _measure_one(
    spec: MethodSpec,
    pair: Pair,
    prompt: BenchPrompt,
    ids: list[int],
    base: SamplingConfig,
    config: BenchConfig,
    index: int,
    order: int,
    energy: EnergyMeter,
    sandbox: SandboxMode,
) -> MethodRecord:
    """One measured decode, then its quality (outside the timed block)."""
    pair.reset_counters()
    seed = config.seed + index
    with measured(pair.device, energy) as cost:
        decoded = _decode(spec, pair, ids, base, seed)
    target_calls = pair.target_counter.calls
    draft_counter = pair.draft_counter
    with pair.target_counter.paused():
        loglik = answer_log_likelihood(pair.target.model, ids, decoded.answer_ids)
    answer = cast(  # one sequence's ids: one text
        str, pair.target.tokenizer.decode(decoded.answer_ids, skip_special_tokens=True)
    )
    completion = passed = execution = None
    if prompt.task_id is not None:
        completion = truncate_completion(answer)
        problem = {
            "prompt": prompt.text,
            "test": prompt.test or "",
            "entry_point": prompt.entry_point or "",
        }
        outcome = check_completion(
            problem, completion, timeout_s=config.humaneval_timeout_s, sandbox=sandbox
        )
        passed, execution = outcome.passed, f"{outcome.status}: {outcome.detail}"[:500]
    return MethodRecord(
        method=spec.name,
        width=spec.width,
        reference=spec.reference,
        prompt_id=prompt.id,
        prompt_index=index,
        order=order,
        seed=seed,
        seconds=cost.seconds,
        cpu_seconds=cost.cpu_seconds,
        tokens=decoded.tokens,
        answer_tokens=len(decoded.answer_ids),
        target_forward_passes=target_calls,
        draft_forward_passes=decoded.lookup_calls
        if decoded.lookup_calls is not None
        else (draft_counter.calls if draft_counter else 0),
        target_kv_peak_bytes=pair.target_counter.kv_peak_bytes,
        target_kv_peak_shape=pair.target_counter.kv_peak_shape,
        draft_kv_peak_bytes=draft_counter.kv_peak_bytes if draft_counter else 0,
        rss_peak_delta_bytes=cost.rss_peak_delta_bytes,
        cuda_peak_bytes=cost.cuda_peak_bytes,
        energy_joules=cost.energy_joules,
        loglik=loglik,
        engine_loglik=decoded.engine_loglik,
        engine_stats=decoded.engine_stats,
        answer=answer,
        completion=completion,
        passed=passed,
        execution=execution,
    )


def _open_run(config: BenchConfig, out_dir: Path, fresh: bool) -> list[MethodRecord]:
    """Records already measured for this config (resume), after checking run.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    run_file, records_file = out_dir / "run.json", out_dir / "records.jsonl"
    if fresh:
        records_file.unlink(missing_ok=True)
    elif run_file.is_file() and records_file.is_file():
        previous = BenchConfig.model_validate_json(run_file.read_text())
        # `prompts` may differ: the first N prompts' records stay valid when N grows or shrinks.
        changed = sorted(
            k
            for k, v in config.model_dump().items()
            if k != "prompts" and previous.model_dump()[k] != v
        )
        if changed:
            raise ResumeMismatchError(
                f"{out_dir} holds a run with another config (differs in {', '.join(changed)}); "
                "pass --fresh to start over, or another --out"
            )
    run_file.write_text(config.model_dump_json(indent=2) + "\n")
    return [r for r in read_records(records_file) if r.prompt_index < config.prompts]


def _write_prompts(path: Path, prompts: list[BenchPrompt], ids: list[list[int]]) -> None:
    with path.open("w") as stream:
        for prompt, prompt_ids in zip(prompts, ids, strict=True):
            stream.write(json.dumps({**prompt.to_dict(), "prompt_ids": prompt_ids}) + "\n")


def _hf_settings(specs: list[MethodSpec], pair: Pair, base: SamplingConfig) -> dict:
    hf = [s for s in specs if not s.engine]
    if not hf:
        return {}
    settings = hf_generation_config(hf[0], base, pair).to_diff_dict()
    settings.pop("num_beams", None)
    lookups = sorted({s.gamma for s in hf if s.family == "hf-lookup"})  # type: ignore[type-var]  # hf-lookup specs carry a gamma
    if lookups:
        settings["prompt_lookup"] = {
            "prompt_lookup_num_tokens": lookups,
            "max_matching_ngram_size": pair.ngram_max,
        }
    if pair.draft is not None:
        assistant = pair.draft.model.generation_config
        settings["assistant"] = {
            key: getattr(assistant, key, None)
            for key in (
                "num_assistant_tokens",
                "num_assistant_tokens_schedule",
                "assistant_confidence_threshold",
            )
        }
        settings["assistant_note"] = (
            "None means transformers' default: 20 tokens, constant schedule, confidence 0.4"
        )
    return settings


def _progress(total: int, done: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, disable=not enabled, dynamic_ncols=True, unit="decode")


def machine_info(device: torch.device) -> dict:
    """Where the figures were measured (a shared machine's load is part of the story)."""
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "platform": platform.platform(),
        "cpu": cpu_model,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "memory_bytes": __import__("psutil").virtual_memory().total,
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def versions() -> dict[str, str]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def git_info() -> dict:
    """Commit of the code that ran, and whether the tree had uncommitted changes."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    # the whole tree's code, not only the package's: a benchmark script that differs from the
    # commit, or is not in it yet, makes a dirty run too (a lent GPU's copy can carry newer
    # files under an older HEAD)
    code = ("--", ":/*.py", ":/*.sh")
    changed = git("diff", "--name-only", "HEAD", *code).splitlines()
    new = git("ls-files", "--others", "--exclude-standard", "--full-name", *code)
    changed += new.splitlines()
    info: dict = {"commit": git("rev-parse", "HEAD"), "dirty_code": bool(changed)}
    if changed:
        info["changed"] = changed[:20]
    sent = os.environ.get("DSBD_SENT_COMMIT")  # the commit the sender says it copied
    if sent:
        info["sent_commit"] = sent
    return info
