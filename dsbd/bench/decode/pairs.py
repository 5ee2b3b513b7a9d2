"""The model pairs `dsbd bench --pair` knows, and what quick and full mode mean for each.

Sizes are chosen for this repository's shared 2-core CPU with one torch thread: quick mode in a
few minutes, full mode well under an hour (smollm2) or one to two hours (qwen-coder, where each
1.5B target forward costs ~0.35 s). Every default can be overridden by a flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsbd.bench.decode.methods import FULL_METHODS, QUICK_METHODS


@dataclass(frozen=True)
class ModeDefaults:
    prompts: int
    max_new_tokens: int
    methods: tuple[str, ...]


@dataclass(frozen=True)
class PairPreset:
    name: str
    target: str
    draft: str
    prompt_set: str
    gamma: int
    quick: ModeDefaults
    full: ModeDefaults

    def mode(self, name: str) -> ModeDefaults:
        return self.quick if name == "quick" else self.full


# The Qwen pair decodes HumanEval completions; each 1.5B target forward costs ~0.35 s of one
# core here (far more when the shared machine is busy), so its method list is the core
# set at W = 3, and a run is resumable and may grow its prompt count (--prompts) later.
_QWEN_METHODS = (
    "sample",
    "sps",
    "beam-w3",
    "dsbd-w3-fixed",
    "dsbd-w3-t0.7",
    "dsbd-w3-t0.7-lean",
    "hf-beam-w3",
    "hf-assisted",
)

PAIRS: dict[str, PairPreset] = {
    "smollm2": PairPreset(
        name="smollm2",
        target="smollm2",
        draft="smollm2-draft",
        prompt_set="held-out",
        gamma=2,
        quick=ModeDefaults(prompts=4, max_new_tokens=32, methods=QUICK_METHODS),
        full=ModeDefaults(prompts=8, max_new_tokens=40, methods=FULL_METHODS),
    ),
    "qwen-coder": PairPreset(
        name="qwen-coder",
        target="qwen-coder",
        draft="qwen-coder-draft",
        prompt_set="humaneval",
        gamma=2,
        quick=ModeDefaults(prompts=1, max_new_tokens=32, methods=_QWEN_METHODS),
        full=ModeDefaults(prompts=21, max_new_tokens=96, methods=_QWEN_METHODS),
    ),
}
