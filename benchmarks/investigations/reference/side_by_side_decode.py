"""One decode on either side of side_by_side.py (beside this file), and its quality.

Ours is measured as `dsbd bench` measures it (`dsbd.bench.decode`); the reference's in its
worker, with the same settings, seed and single stop token.
"""

from __future__ import annotations

from dsbd.bench.decode.humaneval import check_completion, truncate_completion
from dsbd.bench.decode.measure import measured
from dsbd.bench.decode.methods import MethodSpec
from dsbd.bench.decode.quality import answer_log_likelihood
from dsbd.bench.decode.runners import Pair, run_engine
from dsbd.prompts import BenchPrompt
from dsbd_core.algorithm.config import SamplingConfig

# Sibling modules: top-level when side_by_side.py runs as a script (this folder is then on
# sys.path), in the `benchmarks` namespace package when imported from the repo root.
try:
    from side_by_side_sides import RefWorker
except ModuleNotFoundError:
    from benchmarks.investigations.reference.side_by_side_sides import RefWorker


def stop_id(pair: Pair, prompt: BenchPrompt) -> int:
    """The one stop token both sides use for `prompt` (the reference takes a single eos id).

    Chat prompts end at the end-of-turn token (the tokenizer's eos, <|im_end|>), raw
    continuations (docstrings, source, HumanEval) at <|endoftext|>. `dsbd bench` stops at
    either; the reference cannot, so here both sides stop at the same one.
    """
    tokenizer = pair.target.tokenizer
    vocab = tokenizer.get_vocab()
    if not prompt.chat and "<|endoftext|>" in vocab:
        return vocab["<|endoftext|>"]
    return int(tokenizer.eos_token_id)


def reference_config(config: SamplingConfig, eos: int, pad: int) -> dict:
    """The settings the reference worker needs, from the SamplingConfig ours runs with."""
    return {
        "eos_token_id": eos,
        "pad_token_id": pad,
        "max_new_tokens": config.max_new_tokens,
        "gamma": config.gamma,
        "width": config.width,
        "w_min": config.w_min,
        "lean_memory": config.lean_memory,
        "threshold": config.threshold,
        "temperature": config.temperature,
        "top_k": config.top_k,
        "top_p": config.top_p,
    }


def decode_quality(pair: Pair, prompt: BenchPrompt, ids: list[int], answer_ids: list[int], args):
    """Recomputed log-likelihood, the decoded answer and (HumanEval) its test outcome."""
    with pair.target_counter.paused():
        loglik = answer_log_likelihood(pair.target.model, ids, answer_ids)
    answer = pair.target.tokenizer.decode(answer_ids, skip_special_tokens=True)
    if prompt.task_id is None:
        return loglik, answer, {}
    completion = truncate_completion(answer)
    problem = {
        "prompt": prompt.text,
        "test": prompt.test or "",
        "entry_point": prompt.entry_point or "",
    }
    outcome = check_completion(
        problem, completion, timeout_s=args.humaneval_timeout, sandbox=args.sandbox
    )
    return (
        loglik,
        answer,
        {
            "completion": completion,
            "passed": outcome.passed,
            "execution": f"{outcome.status}: {outcome.detail}"[:500],
        },
    )


def decode_ours(spec: MethodSpec, pair: Pair, ids: list[int], config: SamplingConfig, energy):
    """Our decode, measured as `dsbd bench` measures it; returns the MethodRecord fields."""
    pair.reset_counters()
    with measured(pair.device, energy) as cost:
        decoded = run_engine(spec, pair, ids, config)
    draft = pair.draft_counter
    return decoded.answer_ids, {
        "seconds": cost.seconds,
        "cpu_seconds": cost.cpu_seconds,
        "tokens": decoded.tokens,
        "target_forward_passes": pair.target_counter.calls,
        "draft_forward_passes": draft.calls if draft else 0,
        "target_kv_peak_bytes": pair.target_counter.kv_peak_bytes,
        "target_kv_peak_shape": pair.target_counter.kv_peak_shape,
        "draft_kv_peak_bytes": draft.kv_peak_bytes if draft else 0,
        "rss_peak_delta_bytes": cost.rss_peak_delta_bytes,
        "cuda_peak_bytes": cost.cuda_peak_bytes,
        "energy_joules": cost.energy_joules,
        "engine_loglik": decoded.engine_loglik,
        "engine_stats": decoded.engine_stats,
    }


def decode_reference(
    worker: RefWorker, spec: MethodSpec, ids: list[int], config: SamplingConfig, eos: int, pad: int
):
    """The reference's decode in its worker; returns the MethodRecord fields (and its extras)."""
    settings = reference_config(config, eos, pad)
    reply = worker.ask(
        {
            "op": "decode",
            "method": spec.family,
            "prompt_ids": ids,
            "seed": config.seed,
            "config": settings,
        }
    )
    if "error" in reply:
        raise RuntimeError(reply["error"])
    extras = {k: reply[k] for k in ("accepted_layers", "widths") if k in reply}
    return (
        reply["answer_ids"],
        {
            "seconds": reply["seconds"],
            "cpu_seconds": reply["cpu_seconds"],
            "tokens": reply["steps"],
            "target_forward_passes": reply["target_calls"],
            "draft_forward_passes": reply["draft_calls"] if spec.uses_draft else 0,
            "target_kv_peak_bytes": reply["target_kv_peak_bytes"],
            "target_kv_peak_shape": tuple(reply["target_kv_peak_shape"]),
            "draft_kv_peak_bytes": reply["draft_kv_peak_bytes"] if spec.uses_draft else 0,
            "rss_peak_delta_bytes": reply["rss_peak_delta_bytes"],
            "cuda_peak_bytes": None,
            "energy_joules": None,
            "engine_loglik": None,
            "engine_stats": None,
        },
        extras,
    )
