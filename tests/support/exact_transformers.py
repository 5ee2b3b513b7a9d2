"""The exact output law of transformers' beam sampling (`generate(do_sample=True, num_beams=W)`),
by enumeration on n-gram tables: the reference of `tests/algorithm/test_transformers_law.py`.

Written from transformers 5.x's `GenerationMixin._beam_search` step by step (its candidate
draw, `_get_running_beams_for_next_iteration`, `_update_finished_beams`,
`_check_early_stop_heuristic`, `_beam_search_has_unfinished_sequences`) and its sampling
processors, for one prompt, in plain Python + numpy: no import of `dsbd_core`, no code shared
with the engine's search (`dsbd_core/algorithm/search/step.py`, `transformers_law.py`). Where
transformers computes in float32 with -1e9 stand-ins for "no beam here", this computes in
float64 with the same stand-ins; its `torch.multinomial` without replacement is enumerated as
successive sampling over every ordered K-tuple of candidates with mass.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from tests.support.exact_reference import TableLM

BIG = 1.0e9  # transformers' stand-in for "impossible"


def processed_row(
    logp: np.ndarray, temperature: float, top_k: int, top_p: float, keep_at_least: int
) -> np.ndarray:
    """One row of next-token log-probs after transformers' processors, in its order:
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper (-inf = removed)."""
    x = logp / temperature if temperature != 1.0 else logp.copy()
    vocab = x.shape[0]
    if top_k:
        k = min(max(top_k, keep_at_least), vocab)
        kth = np.sort(x)[::-1][k - 1]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1.0:
        order = np.argsort(x, kind="stable")  # ascending
        finite = x[order]
        shifted = np.exp(finite - np.max(finite))
        cumulative = np.cumsum(shifted / shifted.sum())
        remove = cumulative <= 1.0 - top_p
        remove[vocab - keep_at_least :] = False
        x[order[remove]] = -np.inf
    return x


def _ordered_draws(probs: np.ndarray, k: int) -> dict[tuple[int, ...], float]:
    """The law of the set of k candidates `torch.multinomial(probs, k)` (no replacement)
    draws: successive sampling, summed over the orders of each set."""
    support = [i for i in range(len(probs)) if probs[i] > 0]
    if len(support) < k:  # transformers raises here (not enough categories to draw)
        raise ValueError(f"{len(support)} candidates with mass, {k} to draw")
    out: dict[tuple[int, ...], float] = {}
    for order in itertools.permutations(support, k):
        p, left = 1.0, 1.0
        for i in order:
            p *= probs[i] / left
            left -= probs[i]
        key = tuple(sorted(order))
        out[key] = out.get(key, 0.0) + p
    return out


def transformers_beam_outcomes(
    lm: TableLM,
    prompt: Sequence[int],
    width: int,
    max_new_tokens: int,
    eos: set[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    stopped: Callable[[tuple[int, ...]], bool] | None = None,
) -> dict[tuple[tuple[int, ...], ...], float]:
    """Law of the W returned sequences (generated tokens, best first) of transformers' beam
    sampling with `num_return_sequences=W`; `stopped(generated tokens)`: a candidate whose text
    holds a stop string ends there as one ending in EOS does (issue 52)."""
    vocab = lm.vocab_size
    prompt_len = len(prompt)
    max_length = prompt_len + max_new_tokens
    keep = max(2, 1 + len(eos)) * width
    keep_at_least = len(eos) + 1 if width > 1 else 1
    start = {
        "running": [(tuple(prompt), 0.0)] + [(tuple(prompt), -BIG)] * (width - 1),
        "finished": [(tuple(prompt), -BIG, False)] * width,
        "unsatisfied": True,
    }
    frontier = [(start, 1.0)]
    outcomes: dict[tuple[tuple[int, ...], ...], float] = {}
    cur_len = prompt_len
    while frontier:
        next_frontier = []
        for state, mass in frontier:
            candidates = []  # (acc, sequence)
            for seq, acc in state["running"]:
                row = processed_row(lm.next_logprobs(seq), temperature, top_k, top_p, keep_at_least)
                for token in range(vocab):
                    candidates.append((acc + row[token], seq + (token,)))
            scores = np.array([c[0] for c in candidates])
            # softmax of the accumulated scores; the -1e9 stand-ins get exactly 0 (float32)
            live = scores > -BIG / 2
            probs = np.zeros_like(scores)
            probs[live] = np.exp(scores[live] - scores[live].max())
            probs /= probs.sum()
            for chosen, p in _ordered_draws(probs, keep).items():
                top = sorted(chosen, key=lambda i: -scores[i])  # sort by score, descending
                new = _step(
                    state,
                    [candidates[i] for i in top],
                    width,
                    cur_len,
                    prompt_len,
                    max_length,
                    eos,
                    length_penalty,
                    early_stopping,
                    stopped,
                )
                if new is None:
                    continue
                if new["done"]:  # the returned sequences (stand-ins for none left out)
                    key = tuple(
                        s[prompt_len:] for s, score, _ in new["finished"] if score > -BIG / 2
                    )
                    outcomes[key] = outcomes.get(key, 0.0) + mass * p
                else:
                    next_frontier.append((new, mass * p))
        frontier = next_frontier
        cur_len += 1
    return outcomes


def _step(
    state: dict,
    top: list[tuple[float, tuple[int, ...]]],
    width: int,
    cur_len: int,
    prompt_len: int,
    max_length: int,
    eos: set[int],
    length_penalty: float,
    early_stopping: bool | str,
    stopped: Callable[[tuple[int, ...]], bool] | None = None,
) -> dict | None:
    """One step of `_beam_search` after the draw: running beams, finished beams, stopping."""
    hits = [
        seq[-1] in eos
        or len(seq) >= max_length
        or (stopped is not None and stopped(seq[prompt_len:]))
        for _, seq in top
    ]
    # _get_running_beams_for_next_iteration
    running_scores = [acc - BIG * hit for (acc, _), hit in zip(top, hits, strict=True)]
    order = sorted(range(len(top)), key=lambda i: -running_scores[i])[:width]
    running = [(top[i][1], running_scores[i]) for i in order]
    # _update_finished_beams
    finished = state["finished"]
    all_full = all(f for _, _, f in finished) and early_stopping is True
    candidates = []
    for j, ((acc, seq), hit) in enumerate(zip(top, hits, strict=True)):
        just = hit and j < width
        score = acc / ((cur_len + 1 - prompt_len) ** length_penalty)
        score -= BIG * all_full + BIG * (not state["unsatisfied"]) + BIG * (not just)
        candidates.append((seq, score, just))
    merged = list(finished) + candidates
    best = sorted(range(len(merged)), key=lambda i: -merged[i][1])[:width]
    finished = [merged[i] for i in best]
    # cur_len + 1, then _check_early_stop_heuristic
    length = cur_len + 1
    if early_stopping == "never" and length_penalty > 0.0:
        hypothetical = max_length - prompt_len
    else:
        hypothetical = length - prompt_len
    best_running = running[0][1] / (hypothetical**length_penalty)
    worst = min(s for _, s, _ in finished)
    unsatisfied = state["unsatisfied"] and any(
        best_running > (worst if f else -BIG) for _, _, f in finished
    )
    open_beam = not (all(f for _, _, f in finished) and early_stopping is True)
    done = not (unsatisfied and open_beam and not all(hits))
    if any(math.isnan(s) for _, s, _ in finished):
        return None
    return {"running": running, "finished": finished, "unsatisfied": unsatisfied, "done": done}
