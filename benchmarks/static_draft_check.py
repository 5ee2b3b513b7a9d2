"""The draft's log-probabilities on the static and the dynamic path, call by call, at live nodes.

On the Qwen pair the two paths' DSBD decodes part ways although the static target decodes the
dynamic path's tokens (benchmarks/README.md, "The static decode path"). This decodes one held-out
prompt with the dynamic target and each path's draft, records every draft call's log-probs at
live roots and existing nodes, and prints their largest difference per call: ~1e-5 where the
paths agree, nats where the static draft's call differs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/static_draft_check.py --pair qwen-coder
"""

from __future__ import annotations

import argparse

import torch
from static_path_cpu import PAIRS  # benchmarks/ is on sys.path when run as a script

from dsbd_core import SamplingConfig, generate
from dsbd_core.models.pair import load_pair
from dsbd_core.models.static_scorer import StaticScorer
from dsbd_core.models.transformer_scorer import TransformerScorer
from dsbd_core.tools.bench.prompts import prompt_set


class Recorded:
    """A scorer that keeps each forward's log-probs at live roots and existing nodes."""

    def __init__(self, inner: TransformerScorer) -> None:
        self.inner, self.calls, self._alive = inner, [], None

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def set_roots(self, roots) -> None:  # noqa: ANN001
        self._alive = roots.alive.clone()
        self.inner.set_roots(roots)

    def forward(self, layers):  # noqa: ANN001, ANN201
        out = self.inner.forward(layers)
        kept = [] if out.roots is None else [out.roots[self._alive]]
        kept += [x[layer.exists] for x, layer in zip(out.layers, layers, strict=True)]
        which = "roots" if out.roots is not None else "layer"
        self.calls.append((which, [k.clone() for k in kept]))
        return out


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest |difference| over entries finite in both (inf where shapes differ)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            return float("inf")
        finite = torch.isfinite(x) & torch.isfinite(y)
        if finite.any():
            worst = max(worst, float((x - y)[finite].abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="qwen-coder")
    parser.add_argument("--prompt", type=int, default=0, help="index into the held-out prompts")
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(*PAIRS[args.pair], dtype="auto", decode_path="dynamic")
    prompt = prompt_set("held-out")[args.prompt]
    ids = pair.encode(prompt.text, chat=prompt.chat)
    config = SamplingConfig(width=3, gamma=2, threshold=None, max_new_tokens=args.tokens, seed=0,
                            eos_token_ids=tuple(pair.stop_ids))  # fmt: skip
    target = TransformerScorer(pair.target.model)
    drafts = {"dynamic": Recorded(TransformerScorer(pair.draft.model)),
              "static": Recorded(StaticScorer(pair.draft.model))}  # fmt: skip
    results = {path: generate("dsbd", target, ids, config, draft) for path, draft in drafts.items()}
    beams = [r.beams for r in results.values()]
    same = [a.token_ids == b.token_ids for a, b in zip(*beams, strict=False)]
    print(f"{pair.describe()}\nprompt {args.prompt} ({len(ids)} tokens): same beams {same}")
    calls = zip(drafts["dynamic"].calls, drafts["static"].calls, strict=False)
    for index, (a, b) in enumerate(calls):  # the shorter decode's calls
        difference = largest_difference(a[1], b[1])
        print(f"draft call {index:3d} ({a[0]}): largest difference {difference:.3g}")


if __name__ == "__main__":
    main()
