"""The decodes of side_by_side.py (beside this file): set-up and warm-up of both sides, the
alternating schedule, and the scoring done after every timed decode.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from dsbd.bench.decode.measure import EnergyMeter
from dsbd.bench.decode.methods import MethodSpec
from dsbd.bench.decode.schema import MethodRecord
from dsbd.prompts import BenchPrompt
from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.models import encode_prompt

# Sibling modules: top-level when side_by_side.py runs as a script (this folder is then on
# sys.path), in the `benchmarks` namespace package when imported from the repo root.
try:
    from side_by_side_decode import decode_ours, decode_quality, decode_reference, stop_id
    from side_by_side_sides import Sides, parity
except ModuleNotFoundError:
    from benchmarks.investigations.reference.side_by_side_decode import (
        decode_ours,
        decode_quality,
        decode_reference,
        stop_id,
    )
    from benchmarks.investigations.reference.side_by_side_sides import Sides, parity

# (prompt index, method, side, answer ids, MethodRecord fields) of one decode that ran
Decode = tuple[int, MethodSpec, str, list[int], dict]


@dataclass
class Run:
    """One side-by-side run: its settings and prompts, both sides, and how one decode is made.

    `encoded`, `stops` and `pad` come from our tokenizer (`prepare`); both sides decode the same
    token ids and stop at the same token.
    """

    args: argparse.Namespace
    specs: list[MethodSpec]
    prompts: list[BenchPrompt]
    sides: Sides
    energy: EnergyMeter
    encoded: list[list[int]] = field(default_factory=list)
    stops: list[int] = field(default_factory=list)
    pad: int = 0

    def config_for(self, index: int, spec: MethodSpec, tokens: int) -> SamplingConfig:
        args = self.args
        base = SamplingConfig(
            max_new_tokens=tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            gamma=args.gamma,
            seed=args.seed + index,
            eos_token_ids=(self.stops[index],),
        )
        return spec.sampling_config(base)

    def decode(self, source: str, index: int, spec: MethodSpec, tokens: int):
        """(answer ids, MethodRecord fields, accepted layers and widths) of one decode."""
        config = self.config_for(index, spec, tokens)
        if source == "reference":
            return decode_reference(
                self.sides.reference(),
                spec,
                self.encoded[index],
                config,
                self.stops[index],
                self.pad,
            )
        answer_ids, fields = decode_ours(
            spec, self.sides.ours(), self.encoded[index], config, self.energy
        )
        stats = fields["engine_stats"] if spec.uses_draft else None
        extra = (
            {}
            if not stats
            else {
                "accepted_layers": stats["accepted_layers"],
                "widths": [w for it in stats["widths"] for w in it],
            }
        )
        return answer_ids, fields, extra

    def warmup(self, source: str) -> None:
        if self.args.warmup_tokens:
            print(
                f"warm-up of {source}: every method, {self.args.warmup_tokens} tokens "
                "(not recorded)"
            )
            for spec in self.specs:
                self.decode(source, 0, spec, self.args.warmup_tokens)


def prepare(run: Run) -> tuple[list[int], dict]:
    """Encode the prompts, ask the reference for the parity log-probs, warm both sides up.

    Returns the parity check's token ids and the reference's top-k log-probs over them.
    """
    sides = run.sides
    pair = sides.ours()
    run.encoded = [encode_prompt(pair.target, p.text, chat=p.chat) for p in run.prompts]
    run.stops = [stop_id(pair, p) for p in run.prompts]
    run.pad = pair.pad_id
    del pair  # with --low-memory the next line unloads our models: hold no reference to them
    parity_ids = run.encoded[0] + run.encoded[-1][:16]
    theirs = sides.reference().ask({"op": "logprobs", "ids": parity_ids, "k": 20})
    sides.warmup = run.warmup
    run.warmup("reference")
    if not run.args.low_memory:
        run.warmup("dsbd")
    return parity_ids, theirs


def schedule(
    prompts: int, specs: list[MethodSpec], low_memory: bool
) -> list[tuple[int, MethodSpec, str]]:
    """(prompt index, method, side) of every decode, in the order they run."""
    # The schedule: sides alternate which goes first from prompt to prompt. Normally the two
    # sides decode each (prompt, method) back to back; with --low-memory each side decodes all
    # methods of a prompt before the other side is loaded.
    out = []
    for index in range(prompts):
        order = ("reference", "dsbd") if index % 2 == 0 else ("dsbd", "reference")
        if low_memory:
            out += [(index, spec, src) for src in order for spec in specs]
        else:
            out += [(index, spec, src) for spec in specs for src in order]
    return out


def run_schedule(
    run: Run, steps: list[tuple[int, MethodSpec, str]]
) -> tuple[list[Decode], dict, list[dict]]:
    """Every decode of `steps`: the decodes that ran, their speculation extras, the errors."""
    decodes: list[Decode] = []
    speculation: dict = {s.name: {"reference": {}, "dsbd": {}} for s in run.specs}
    errors: list[dict] = []
    for step, (index, spec, source) in enumerate(steps):
        prompt = run.prompts[index]
        try:
            answer_ids, fields, extra = run.decode(source, index, spec, run.args.max_new_tokens)
        except RuntimeError as error:  # the reference raises on some inputs (ALGORITHM.md §9.3)
            errors.append(
                {"prompt_id": prompt.id, "method": spec.name, "source": source, "error": str(error)}
            )
            print(f"[{step + 1}/{len(steps)}] {prompt.id} {spec.name} {source}: {error}")
            continue
        fields["order"] = step
        decodes.append((index, spec, source, answer_ids, fields))
        speculation[spec.name][source][prompt.id] = extra
        print(
            f"[{step + 1}/{len(steps)}] {prompt.id:18s} {spec.name:22s} {source:9s} "
            f"{fields['seconds']:7.2f}s steps {fields['tokens']:3d} target calls "
            f"{fields['target_forward_passes']:3d}",
            flush=True,
        )
    return decodes, speculation, errors


def score(
    run: Run, decodes: list[Decode], theirs: dict, parity_ids: list[int]
) -> tuple[dict, list[MethodRecord]]:
    """The parity check and every decode's MethodRecord (log-likelihood, HumanEval)."""
    # Scoring, outside every timed block: recomputed log-likelihood, HumanEval, parity.
    args = run.args
    pair = run.sides.ours()
    check = parity(theirs, pair.target.model, pair.draft.model, parity_ids)
    print(f"parity (ours vs reference loading): {json.dumps(check)}", flush=True)
    records: list[MethodRecord] = []
    for index, spec, source, answer_ids, fields in decodes:
        prompt = run.prompts[index]
        loglik, answer, humaneval = decode_quality(
            pair, prompt, run.encoded[index], answer_ids, args
        )
        records.append(
            MethodRecord(
                source=source,
                method=spec.name,
                width=spec.width,
                reference=spec.reference,
                prompt_id=prompt.id,
                prompt_index=index,
                seed=args.seed + index,
                answer_tokens=len(answer_ids),
                loglik=loglik,
                answer=answer,
                **fields,
                **humaneval,
            )
        )
    return check, records
