"""The draft's log-probabilities on the static and the dynamic path, call by call, at live nodes.

Both paths' draft scorers are fed the same calls in lockstep (the dynamic one's answer drives
the decode, so a difference shows at the call that makes it and does not spread through a
decode that went another way), over one held-out prompt with the dynamic target. Per call it
prints the largest log-prob difference and the largest total variation at live roots and
existing nodes. On the Qwen pair (README.md in this folder): ~1e-5 at
every call with the draft in float32 (`--quantize none`); with its int8 layers the paths part
where the static step's other summation order moves an int8 rounding.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/investigations/static_path/static_draft_check.py \
        --pair qwen-coder [--quantize none]
"""

from __future__ import annotations

import argparse

import torch
from static_path_cpu import PAIRS  # this folder is on sys.path when run as a script

from dsbd.prompts import prompt_set
from dsbd_core import SamplingConfig, generate
from dsbd_core.models.pair import DraftOptions, load_pair
from dsbd_core.models.static_scorer import StaticScorer
from dsbd_core.models.transformer_scorer import TransformerScorer


class Lockstep:
    """Both paths' draft scorers fed the same calls; the dynamic one's answer drives the decode,
    so a difference shows at the call that makes it and does not spread to later calls through
    a decode that went another way. Keeps each call's largest difference at live entries."""

    def __init__(self, dynamic: TransformerScorer, static: StaticScorer) -> None:
        self.dynamic, self.static = dynamic, static
        self.calls: list[tuple[str, float, float]] = []
        self._alive: torch.Tensor | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self.dynamic, name)

    def set_roots(self, roots) -> None:  # noqa: ANN001
        self._alive = roots.alive.clone()
        self.dynamic.set_roots(roots)
        self.static.set_roots(roots)

    def release(self) -> None:
        self.dynamic.release()
        self.static.release()

    def forward(self, layers):  # noqa: ANN001, ANN201
        outs = [scorer.forward(layers) for scorer in (self.dynamic, self.static)]
        kept = [[] if out.roots is None else [out.roots[self._alive]] for out in outs]
        for k, out in zip(kept, outs, strict=True):
            k += [x[layer.exists] for x, layer in zip(out.layers, layers, strict=True)]
        which = "roots" if outs[0].roots is not None else "layer"
        self.calls.append((which, largest_difference(*kept), largest_tv(*kept)))
        return outs[0]


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


def largest_tv(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest total variation distance between the two paths' distributions at a node."""
    tv = [0.5 * (x.exp() - y.exp()).abs().sum(-1) for x, y in zip(a, b, strict=True)]
    return max((float(t.max()) for t in tv if t.numel()), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="qwen-coder")
    parser.add_argument("--prompt", type=int, default=0, help="index into the held-out prompts")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument(
        "--quantize",
        choices=["auto", "int8", "none"],
        default="auto",
        help="the draft's int8 layers (DraftOptions.quantize)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(
        *PAIRS[args.pair],
        dtype="auto",
        decode_path="dynamic",
        draft_options=DraftOptions(quantize=args.quantize),
    )
    prompt = prompt_set("held-out")[args.prompt]
    ids = pair.encode(prompt.text, chat=prompt.chat)
    config = SamplingConfig(
        width=3,
        gamma=2,
        threshold=None,
        max_new_tokens=args.tokens,
        seed=0,
        eos_token_ids=tuple(pair.stop_ids),
    )
    target = TransformerScorer(pair.target.model)
    draft = Lockstep(TransformerScorer(pair.draft.model), StaticScorer(pair.draft.model))
    result = generate("dsbd", target, ids, config, draft)
    print(
        f"{pair.describe()}\nprompt {args.prompt} ({len(ids)} tokens), "
        f"{len(result.beams[0].token_ids)} tokens decoded"
    )
    for index, (which, difference, tv) in enumerate(draft.calls):
        print(
            f"draft call {index:3d} ({which}): largest log-prob difference {difference:.3g}, "
            f"largest TV {tv:.3g}"
        )


if __name__ == "__main__":
    main()
