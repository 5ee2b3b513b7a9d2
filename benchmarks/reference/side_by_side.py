"""Our DSBD against the reference implementation (ZongyueQin/DSBD), same pair, prompts, settings.

The reference runs in its own venv (transformers 4.35.2) inside a long-lived worker process
(`ref_worker.py`); ours runs in this process (our venv) through the `dsbd bench` harness's own
pieces (`dsbd_core.tools.bench`: prompt sets, method names, runners, measurement, quality), so our
figures here are measured exactly as `dsbd bench` measures them. For every prompt and method the
two sides run back to back and alternate which goes first, so slow phases of the shared, noisy
CPU hit both alike; both use one torch thread, the same seed and the same stop token.

Per decode, both sides: wall and CPU time of the decode call, decoding steps, target and draft
forward calls (forward hooks on both sides), peak KV-cache bytes, and quality: the target
log-likelihood of the returned answer recomputed here by our target model, and HumanEval
pass@1 (sandboxed) on the `humaneval` prompt set.

    .venv/bin/python benchmarks/reference/side_by_side.py --pair smollm2
    .venv/bin/python benchmarks/reference/side_by_side.py --pair qwen-coder --prompts 4

Outputs (default stem benchmarks/results/reference/<pair>_<set>_n<N>_m<tokens>):
  <stem>.json            settings, versions, parity check, per-method comparison, all records
  <stem>.records.jsonl   the reference's MethodRecords (`dsbd bench --extra-records` folds them in)
  <stem>.md              the comparison as a markdown table
Set-up of the reference venv and checkout: benchmarks/reference/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.models import encode_prompt, load_causal_lm, prepare_preset
from dsbd_core.tools.bench.humaneval import check_completion, default_sandbox, truncate_completion
from dsbd_core.tools.bench.measure import EnergyMeter, measured
from dsbd_core.tools.bench.methods import MethodSpec, parse_methods
from dsbd_core.tools.bench.prompts import PROMPT_SETS, BenchPrompt, prompt_set
from dsbd_core.tools.bench.quality import answer_log_likelihood, paired_bootstrap, ratio_bootstrap
from dsbd_core.tools.bench.runners import Pair, run_engine
from dsbd_core.tools.bench.schema import MethodRecord

HERE = Path(__file__).resolve().parent
PAIRS = {
    "smollm2": ("smollm2", "smollm2-draft", "held-out"),
    "qwen-coder": ("qwen-coder", "qwen-coder-draft", "humaneval"),
}
REFERENCE_FAMILIES = ("dsbd", "sps", "beam", "sample")  # what the reference code implements


class RefWorker:
    """The reference worker subprocess: one JSON request per line, one JSON reply per line."""

    def __init__(self, python: str, ref_dir: str, target: Path, draft: Path, threads: int, log):
        cmd = [python, str(HERE / "ref_worker.py"), "--ref-dir", ref_dir, "--target", str(target),
               "--draft", str(draft), "--threads", str(threads)]  # fmt: skip
        # Same niceness as this process (inherited): both sides must compete for the CPU alike.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, bufsize=1)  # fmt: skip
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
        report[name] = {"max_abs_logprob_diff_topk": diff, "top1_agreement": top1,
                        "k": idx.shape[1]}  # fmt: skip
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
            self._pair = Pair(target, draft, torch.device("cpu"),
                              (int(target.tokenizer.eos_token_id),))  # fmt: skip
            self.loads["dsbd"] += 1
            self.warmup("dsbd")
        return self._pair

    def reference(self) -> RefWorker:
        if self.args.low_memory:
            self.drop_ours()
        if self._worker is None:
            with open(self.log_path, "a") as log:
                self._worker = RefWorker(self.args.ref_python, self.args.ref_dir,
                                         *(prepare_preset(n) for n in self.names),
                                         self.args.threads, log)  # fmt: skip
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
        "eos_token_id": eos, "pad_token_id": pad, "max_new_tokens": config.max_new_tokens,
        "gamma": config.gamma, "width": config.width, "w_min": config.w_min,
        "lean_memory": config.lean_memory, "threshold": config.threshold,
        "temperature": config.temperature, "top_k": config.top_k, "top_p": config.top_p,
    }  # fmt: skip


def _quality(pair: Pair, prompt: BenchPrompt, ids: list[int], answer_ids: list[int], args):
    """Recomputed log-likelihood, the decoded answer and (HumanEval) its test outcome."""
    with pair.target_counter.paused():
        loglik = answer_log_likelihood(pair.target.model, ids, answer_ids)
    answer = pair.target.tokenizer.decode(answer_ids, skip_special_tokens=True)
    if prompt.task_id is None:
        return loglik, answer, {}
    completion = truncate_completion(answer)
    problem = {"prompt": prompt.text, "test": prompt.test or "",
               "entry_point": prompt.entry_point or ""}  # fmt: skip
    outcome = check_completion(problem, completion, timeout_s=args.humaneval_timeout,
                               sandbox=args.sandbox)  # fmt: skip
    return loglik, answer, {"completion": completion, "passed": outcome.passed,
                            "execution": f"{outcome.status}: {outcome.detail}"[:500]}  # fmt: skip


def decode_ours(spec: MethodSpec, pair: Pair, ids: list[int], config: SamplingConfig, energy):
    """Our decode, measured as `dsbd bench` measures it; returns the MethodRecord fields."""
    pair.reset_counters()
    with measured(pair.device, energy) as cost:
        decoded = run_engine(spec, pair, ids, config)
    draft = pair.draft_counter
    return decoded.answer_ids, {
        "seconds": cost.seconds, "cpu_seconds": cost.cpu_seconds, "tokens": decoded.tokens,
        "target_forward_passes": pair.target_counter.calls,
        "draft_forward_passes": draft.calls if draft else 0,
        "target_kv_peak_bytes": pair.target_counter.kv_peak_bytes,
        "target_kv_peak_shape": pair.target_counter.kv_peak_shape,
        "draft_kv_peak_bytes": draft.kv_peak_bytes if draft else 0,
        "rss_peak_delta_bytes": cost.rss_peak_delta_bytes, "cuda_peak_bytes": cost.cuda_peak_bytes,
        "energy_joules": cost.energy_joules, "engine_loglik": decoded.engine_loglik,
        "engine_stats": decoded.engine_stats,
    }  # fmt: skip


def decode_reference(worker: RefWorker, spec: MethodSpec, ids: list[int], config: SamplingConfig,
                     eos: int, pad: int):  # fmt: skip
    """The reference's decode in its worker; returns the MethodRecord fields (and its extras)."""
    settings = reference_config(config, eos, pad)
    reply = worker.ask({"op": "decode", "method": spec.family, "prompt_ids": ids,
                        "seed": config.seed, "config": settings})  # fmt: skip
    if "error" in reply:
        raise RuntimeError(reply["error"])
    extras = {k: reply[k] for k in ("accepted_layers", "widths") if k in reply}
    return reply["answer_ids"], {
        "seconds": reply["seconds"], "cpu_seconds": reply["cpu_seconds"], "tokens": reply["steps"],
        "target_forward_passes": reply["target_calls"],
        "draft_forward_passes": reply["draft_calls"] if spec.uses_draft else 0,
        "target_kv_peak_bytes": reply["target_kv_peak_bytes"],
        "target_kv_peak_shape": tuple(reply["target_kv_peak_shape"]),
        "draft_kv_peak_bytes": reply["draft_kv_peak_bytes"] if spec.uses_draft else 0,
        "rss_peak_delta_bytes": reply["rss_peak_delta_bytes"], "cuda_peak_bytes": None,
        "energy_joules": None, "engine_loglik": None, "engine_stats": None,
    }, extras  # fmt: skip


def compare(method: str, records: list[MethodRecord], speculation: dict, budget: int) -> dict:
    """Reference vs ours for one method: per-token rates, quality, paired over prompts."""
    sides = {s: {r.prompt_id: r for r in records if r.method == method and r.source == s}
             for s in ("reference", "dsbd")}  # fmt: skip
    prompts = [p for p in sides["dsbd"] if p in sides["reference"]]
    ref = [sides["reference"][p] for p in prompts]
    ours = [sides["dsbd"][p] for p in prompts]
    if not prompts:
        return {"prompts": 0}

    def side(rows: list[MethodRecord], key: str) -> dict:
        tokens = sum(r.tokens for r in rows)
        extra = [speculation.get(key, {}).get(p, {}) for p in prompts]
        accepted = [a for e in extra for a in e.get("accepted_layers", [])]
        widths = [w for e in extra for w in e.get("widths", [])]
        passed = [r.passed for r in rows if r.passed is not None]
        return {
            "tokens": tokens,
            "answer_tokens": sum(r.answer_tokens for r in rows),
            "seconds_per_token": sum(r.seconds for r in rows) / tokens,
            "cpu_seconds_per_token": sum(r.cpu_seconds for r in rows) / tokens,
            "target_passes_per_token": sum(r.target_forward_passes for r in rows) / tokens,
            "draft_passes_per_token": sum(r.draft_forward_passes for r in rows) / tokens,
            "mean_accepted_length": sum(accepted) / len(accepted) if accepted else None,
            "mean_width": sum(widths) / len(widths) if widths else None,
            "target_kv_peak_bytes_max": max(r.target_kv_peak_bytes for r in rows),
            "loglik_per_token": sum(r.loglik / max(r.answer_tokens, 1) for r in rows) / len(rows),
            "pass_at_1": sum(passed) / len(passed) if passed else None,
            "decodes_over_budget": sum(r.tokens > budget for r in rows),
        }

    per_token = [(a.loglik / max(a.answer_tokens, 1)) - (b.loglik / max(b.answer_tokens, 1))
                 for a, b in zip(ref, ours, strict=True)]  # fmt: skip
    return {
        "prompts": len(prompts),
        "reference": side(ref, "reference"),
        "ours": side(ours, "dsbd"),
        "time_per_token_reference_over_ours": ratio_bootstrap(
            [(r.seconds, r.tokens) for r in ref], [(r.seconds, r.tokens) for r in ours]
        ),
        "cpu_per_token_reference_over_ours": ratio_bootstrap(
            [(r.cpu_seconds, r.tokens) for r in ref], [(r.cpu_seconds, r.tokens) for r in ours]
        ),
        "loglik_per_token_reference_minus_ours": paired_bootstrap(per_token),
    }


def markdown(result: dict) -> str:
    """The comparison as one markdown table (ratios > 1: the reference is slower)."""
    s = result["settings"]
    lines = [
        f"# Reference (ZongyueQin/DSBD @ {result['reference']['commit'][:10]}) vs ours: "
        f"{result['pair']['name']}",
        "",
        f"target `{result['pair']['target']}`, draft `{result['pair']['draft']}`; "
        f"{s['prompts']} prompts of `{s['prompt_set']}`, max {s['max_new_tokens']} new tokens, "
        f"T = {s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}, seed {s['seed']} + i; "
        f"1 torch thread each, sides alternating per prompt; {result['created_note']}.",
        "",
        "| method | side | ms/token | ref/ours time [95% CI] | target passes/token | "
        "draft passes/token | accepted length | mean width | loglik/token | pass@1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, c in result["comparison"].items():
        if not c.get("prompts"):
            lines.append(f"| {method} | - | no paired decodes | | | | | | | |")
            continue
        r = c["time_per_token_reference_over_ours"]
        ratio = f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
        for name in ("reference", "ours"):
            x = c[name]
            lines.append(
                f"| {method} | {name} | {1000 * x['seconds_per_token']:.0f} | "
                f"{ratio if name == 'reference' else ''} | {x['target_passes_per_token']:.3f} | "
                f"{x['draft_passes_per_token']:.3f} | {_f(x['mean_accepted_length'], '.2f')} | "
                f"{_f(x['mean_width'], '.2f')} | {x['loglik_per_token']:.3f} | "
                f"{_f(x['pass_at_1'], '.2f')} |"
            )
    q = result["parity"]
    lines += [
        "",
        f"Parity of the reference's model loading with ours (top-20 log-probs at {q['positions']}"
        f" positions): target max |diff| {q['target']['max_abs_logprob_diff_topk']:.1e}, "
        f"draft {q['draft']['max_abs_logprob_diff_topk']:.1e}.",
        "",
    ]
    return "\n".join(lines)


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--prompt-set", choices=PROMPT_SETS, help="default: the pair's")
    parser.add_argument("--prompts", type=int, default=8, help="the first N of the set")
    parser.add_argument(
        "--methods",
        default="dsbd-w3-t0.7,dsbd-w3-fixed,beam-w3",
        help="names in the dsbd bench grammar; families: " + ", ".join(REFERENCE_FAMILIES),
    )
    parser.add_argument("--gamma", type=int, default=2, help="draft depth where a name has no g")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup-tokens", type=int, default=4)
    parser.add_argument("--humaneval-timeout", type=float, default=10.0)
    parser.add_argument("--sandbox", default=None, help="HumanEval sandbox (default: best)")
    parser.add_argument("--ref-python", default="/work/ref/venv/bin/python")
    parser.add_argument("--ref-dir", default="/work/ref/DSBD")
    parser.add_argument("--out", help="output stem (default benchmarks/results/reference/...)")
    parser.add_argument(
        "--low-memory",
        action="store_true",
        help="only one side's models in memory at a time (sides then alternate per prompt)",
    )
    args = parser.parse_args()
    specs = parse_methods(args.methods, gamma=args.gamma)
    unsupported = [s.name for s in specs if s.family not in REFERENCE_FAMILIES]
    if unsupported:
        parser.error(f"--methods: {unsupported} have no counterpart in the reference code")
    target_name, draft_name, default_set = PAIRS[args.pair]
    args.prompt_set = args.prompt_set or default_set
    args.sandbox = args.sandbox or default_sandbox()
    torch.set_num_threads(args.threads)
    filters = f"_k{args.top_k}_p{args.top_p:g}" if args.top_k or args.top_p < 1.0 else ""
    stem = f"{args.pair}_{args.prompt_set}_n{args.prompts}_m{args.max_new_tokens}{filters}"
    out = Path(args.out or f"benchmarks/results/reference/{stem}")
    out.parent.mkdir(parents=True, exist_ok=True)

    prompts = prompt_set(args.prompt_set)[: args.prompts]
    Path(f"{out}.worker.log").write_text("")

    def config_for(index: int, spec: MethodSpec, tokens: int) -> SamplingConfig:
        base = SamplingConfig(
            max_new_tokens=tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, gamma=args.gamma, seed=args.seed + index,
            eos_token_ids=(stops[index],),
        )  # fmt: skip
        return spec.sampling_config(base)

    def decode(source: str, index: int, spec: MethodSpec, tokens: int):
        """(answer ids, MethodRecord fields, accepted layers and widths) of one decode."""
        config = config_for(index, spec, tokens)
        if source == "reference":
            return decode_reference(sides.reference(), spec, encoded[index], config,
                                    stops[index], pad)  # fmt: skip
        answer_ids, fields = decode_ours(spec, sides.ours(), encoded[index], config, energy)
        stats = fields["engine_stats"] if spec.uses_draft else None
        extra = {} if not stats else {
            "accepted_layers": stats["accepted_layers"],
            "widths": [w for it in stats["widths"] for w in it],
        }  # fmt: skip
        return answer_ids, fields, extra

    def warmup(source: str) -> None:
        if args.warmup_tokens:
            print(f"warm-up of {source}: every method, {args.warmup_tokens} tokens (not recorded)")
            for spec in specs:
                decode(source, 0, spec, args.warmup_tokens)

    energy = EnergyMeter(torch.device("cpu"))
    sides = Sides(args, (target_name, draft_name), f"{out}.worker.log")
    pair = sides.ours()
    encoded = [encode_prompt(pair.target, p.text, chat=p.chat) for p in prompts]
    stops = [stop_id(pair, p) for p in prompts]
    pad = pair.pad_id
    del pair  # with --low-memory the next line unloads our models: hold no reference to them
    parity_ids = encoded[0] + encoded[-1][:16]
    theirs = sides.reference().ask({"op": "logprobs", "ids": parity_ids, "k": 20})
    sides.warmup = warmup
    warmup("reference")
    if not args.low_memory:
        warmup("dsbd")

    # The schedule: sides alternate which goes first from prompt to prompt. Normally the two
    # sides decode each (prompt, method) back to back; with --low-memory each side decodes all
    # methods of a prompt before the other side is loaded.
    schedule = []
    for index in range(len(prompts)):
        order = ("reference", "dsbd") if index % 2 == 0 else ("dsbd", "reference")
        if args.low_memory:
            schedule += [(index, spec, src) for src in order for spec in specs]
        else:
            schedule += [(index, spec, src) for spec in specs for src in order]
    decodes: list[tuple[int, MethodSpec, str, list[int], dict]] = []
    speculation: dict = {s.name: {"reference": {}, "dsbd": {}} for s in specs}
    errors: list[dict] = []
    for step, (index, spec, source) in enumerate(schedule):
        prompt = prompts[index]
        try:
            answer_ids, fields, extra = decode(source, index, spec, args.max_new_tokens)
        except RuntimeError as error:  # the reference raises on some inputs (spec §9.3)
            errors.append({"prompt_id": prompt.id, "method": spec.name, "source": source,
                           "error": str(error)})  # fmt: skip
            print(f"[{step + 1}/{len(schedule)}] {prompt.id} {spec.name} {source}: {error}")
            continue
        fields["order"] = step
        decodes.append((index, spec, source, answer_ids, fields))
        speculation[spec.name][source][prompt.id] = extra
        print(f"[{step + 1}/{len(schedule)}] {prompt.id:18s} {spec.name:22s} {source:9s} "
              f"{fields['seconds']:7.2f}s steps {fields['tokens']:3d} target calls "
              f"{fields['target_forward_passes']:3d}", flush=True)  # fmt: skip
    sides.close_reference()

    # Scoring, outside every timed block: recomputed log-likelihood, HumanEval, parity.
    pair = sides.ours()
    check = parity(theirs, pair.target.model, pair.draft.model, parity_ids)
    print(f"parity (ours vs reference loading): {json.dumps(check)}", flush=True)
    records: list[MethodRecord] = []
    for index, spec, source, answer_ids, fields in decodes:
        prompt = prompts[index]
        loglik, answer, humaneval = _quality(pair, prompt, encoded[index], answer_ids, args)
        records.append(MethodRecord(
            source=source, method=spec.name, width=spec.width, reference=spec.reference,
            prompt_id=prompt.id, prompt_index=index, seed=args.seed + index,
            answer_tokens=len(answer_ids), loglik=loglik, answer=answer, **fields, **humaneval,
        ))  # fmt: skip

    comparison = {
        spec.name: compare(spec.name, records, speculation[spec.name], args.max_new_tokens)
        for spec in specs
    }
    result = {
        "pair": {"name": args.pair, "target": target_name, "draft": draft_name},
        "settings": {k: v for k, v in vars(args).items() if k not in ("ref_python", "ref_dir")},
        "command": sys.argv,
        "prompts": [
            {**p.to_dict(), "prompt_ids": ids, "stop_id": stop}
            for p, ids, stop in zip(prompts, encoded, stops, strict=True)
        ],  # fmt: skip
        "reference": {**sides.hello, "commit": _ref_commit(args.ref_dir)},
        "model_loads": sides.loads,
        "ours_versions": {"torch": torch.__version__, "transformers": _transformers_version()},
        "parity": check,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "load_average_end": list(_load_average()),
            "nice": os.nice(0),
            "threads": torch.get_num_threads(),
        },  # fmt: skip
        "created_note": f"load average at the end {tuple(round(x, 2) for x in _load_average())}",
        "comparison": comparison,
        "errors": errors,
        "speculation": speculation,
        "records": [r.model_dump() for r in records],
    }
    Path(f"{out}.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(f"{out}.records.jsonl", "w") as stream:
        for record in records:
            if record.source == "reference":
                stream.write(record.model_dump_json() + "\n")
    Path(f"{out}.md").write_text(markdown(result))
    print(Path(f"{out}.md").read_text())
    print(f"wrote {out}.json, {out}.records.jsonl, {out}.md")


def _load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def _ref_commit(ref_dir: str) -> str:
    done = subprocess.run(["git", "-C", ref_dir, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False)  # fmt: skip
    return done.stdout.strip()


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
