"""Independent exact reference for the statistical exactness tests (ALGORITHM.md §1, §4.4,
§4.5, §12).

Why this file exists: the claims "DSBD follows target beam sampling" and "W = 1 is ordinary
sampling" are statements about *distributions*. They can only be tested against a distribution
that is known exactly, computed by code that shares nothing with the engine. This module is that
code: plain Python + numpy, no import of ``dsbd_core``, small enough to audit by reading.

Contents
* ``TableLM`` / ``random_table``: n-gram toy language models over a tiny vocabulary.
* ``joint_filter``: temperature, joint top-k and top-p over one flattened candidate table.
* ``beam_sampling_outcomes``: exact outcome distribution of target beam sampling (both the
  ``"with_replacement"`` and the ``"distinct"`` mode), by enumeration with merged states.
* ``best_answer_distribution`` / ``best_answer``: the final selection rule.
* ``multinomial_outcomes``: exact distribution of plain ancestral sampling.
* ``empirical``, ``tv``, ``null_tv_quantile``, ``assert_matches``: the statistical harness
  (in tests/support/exact_statistics.py, re-exported here).

Outcome format: an outcome of beam sampling is the multiset of *all* final beams (finished and
still active), written as a sorted tuple of generated-token tuples (the prompt is not included,
EOS tokens are). Samplers under test must map their result to the same canonical form.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from itertools import combinations, combinations_with_replacement, permutations

import numpy as np

# The statistical harness lives in its own module; importers keep naming it from here.
from .exact_statistics import assert_matches as assert_matches
from .exact_statistics import empirical as empirical
from .exact_statistics import null_tv_quantile as null_tv_quantile
from .exact_statistics import tv as tv

MODES = ("with_replacement", "distinct")

Beam = tuple[int, ...]
Outcome = tuple[Beam, ...]
# Stop strings and the text of each token id: a beam whose text (its tokens' texts joined)
# holds a stop string has finished, as one ending in an EOS token has. A third entry, vLLM's
# min_tokens, ignores a match before that many generated tokens (for good: only a match that
# ends in the last token then counts).
Stops = tuple[tuple[str, ...], tuple[str, ...]] | tuple[tuple[str, ...], tuple[str, ...], int]


def _stopped(beam: Beam, stops: Stops | None) -> bool:
    """Whether ``beam`` finishes at its last token by a stop string."""
    if stops is None:
        return False
    strings, texts, *rest = stops
    min_tokens = int(rest[0]) if rest else 0
    text = "".join(texts[t] for t in beam)
    if not min_tokens:
        return any(s in text for s in strings)
    if len(beam) < min_tokens:
        return False
    before = len(text) - len(texts[beam[-1]])  # the match must end past this
    return any(text.find(s, max(0, before - len(s) + 1)) >= 0 for s in strings)


# --------------------------------------------------------------------------------------------
# Toy language models
# --------------------------------------------------------------------------------------------


class TableLM:
    """An n-gram language model given by a full log-probability table.

    ``logp`` has shape ``[V] * order``: order 2 is a bigram ``logp[prev, next]``, order 3 a
    trigram ``logp[prev2, prev1, next]``. Every row (last axis) must be a normalised
    distribution in log space; ``-inf`` marks an exact zero. A tiny table makes every sequence
    probability computable by hand, which is what exact enumeration needs.
    """

    def __init__(self, logp: np.ndarray) -> None:
        table = np.asarray(logp, dtype=np.float64)
        if table.ndim < 1 or len(set(table.shape)) != 1:
            raise ValueError(f"logp must have shape [V]*order, got {table.shape}")
        mass = np.exp(table).sum(axis=-1)
        if not np.allclose(mass, 1.0, atol=1e-9):
            raise ValueError("every row of logp must be a normalised distribution")
        self.logp = table
        self.order = table.ndim
        self.vocab_size = table.shape[0]

    def next_logprobs(self, seq: Sequence[int]) -> np.ndarray:
        """Raw next-token log-probabilities ``[V]`` given the whole sequence so far.

        Only the last ``order - 1`` tokens matter; the sequence (prompt + generated tokens)
        must be at least that long. Returns a copy so callers cannot corrupt the table.
        """
        context_len = self.order - 1
        if context_len == 0:
            return self.logp.copy()
        if len(seq) < context_len:
            raise ValueError(f"sequence {tuple(seq)} shorter than the context {context_len}")
        context = tuple(int(t) for t in seq[len(seq) - context_len :])
        return self.logp[context].copy()

    def sequence_logprob(self, prompt: Sequence[int], tokens: Sequence[int]) -> float:
        """True cumulative log-probability of ``tokens`` generated after ``prompt``."""
        seq = list(prompt)
        total = 0.0
        for token in tokens:
            total += float(self.next_logprobs(seq)[token])
            seq.append(token)
        return total


def random_table(
    rng: np.random.Generator,
    vocab_size: int,
    order: int,
    concentration: float,
    zero_prob: float = 0.0,
) -> np.ndarray:
    """Random normalised log-prob table of shape ``[vocab_size] * order``.

    Rows are Dirichlet(``concentration``) draws (small concentration = peaky rows). With
    ``zero_prob > 0`` each entry is independently set to an exact zero (``-inf``) with that
    probability, keeping at least one entry per row, so tests can build the "zero mass where
    the other model has mass" cases. Returns the table; wrap it in ``TableLM``.
    """
    if vocab_size < 1 or order < 1 or concentration <= 0 or not 0.0 <= zero_prob < 1.0:
        raise ValueError("need vocab_size >= 1, order >= 1, concentration > 0, 0 <= zero_prob < 1")
    shape = (vocab_size,) * order
    rows = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size ** (order - 1))
    if zero_prob > 0.0:
        zero = rng.random(rows.shape) < zero_prob
        # Keep each row's largest entry so that every context still has mass.
        zero[np.arange(rows.shape[0]), rows.argmax(axis=1)] = False
        rows = np.where(zero, 0.0, rows)
    rows = rows / rows.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        return np.log(rows).reshape(shape)


# --------------------------------------------------------------------------------------------
# Filtering
# --------------------------------------------------------------------------------------------


def joint_filter(x: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Distribution over the entries of a flattened candidate table after joint filtering.

    ``x`` holds log-weights (``-inf`` = excluded). Steps, as the engine defines them
    (ALGORITHM.md §1.1 step 2): divide finite entries by ``temperature``; top-k keeps the
    ``top_k`` largest entries plus every entry tied with the k-th value (0 = off, k >= #finite
    keeps all); top-p sorts the
    kept entries by probability (softmax of the tempered values over the kept entries),
    descending with ties broken by the smaller index, and keeps the shortest prefix whose
    cumulative mass reaches ``top_p`` including the entry that crosses (1.0 = off); finally a
    softmax over the kept entries. Returns probabilities with the shape of ``x``.

    Cumulative sums landing within rounding error of ``top_p`` are inherently ambiguous between
    implementations; test configurations should avoid them.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError("joint_filter expects a 1-D (flattened) table")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got {top_k}, {top_p}")
    keep = np.isfinite(x)
    if not keep.any():
        raise ValueError("no candidate has finite weight")
    z = np.full_like(x, -np.inf)
    z[keep] = x[keep] / temperature

    n_finite = int(keep.sum())
    if 0 < top_k < n_finite:
        kth_value = np.sort(z[keep])[::-1][top_k - 1]
        keep &= z >= kth_value

    if top_p < 1.0:
        probs = _softmax_over(z, keep)
        kept_idx = np.flatnonzero(keep)
        # Stable sort of -prob: equal probabilities stay in index order.
        order = kept_idx[np.argsort(-probs[kept_idx], kind="stable")]
        cumulative = np.cumsum(probs[order])
        reached = np.flatnonzero(cumulative >= top_p)
        n_keep = int(reached[0]) + 1 if reached.size else len(order)
        keep = np.zeros_like(keep)
        keep[order[:n_keep]] = True

    return _softmax_over(z, keep)


def _softmax_over(z: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Softmax of ``z`` restricted to ``keep`` (zeros elsewhere)."""
    out = np.zeros_like(z)
    top = z[keep].max()
    out[keep] = np.exp(z[keep] - top)
    return out / out.sum()


# --------------------------------------------------------------------------------------------
# Exact beam sampling
# --------------------------------------------------------------------------------------------


class _ScoreCache:
    """Memoised raw scores and next-token rows of generated-token tuples after one prompt."""

    def __init__(self, lm: TableLM, prompt: tuple[int, ...]) -> None:
        self.lm = lm
        self.prompt = prompt
        self._rows: dict[Beam, np.ndarray] = {}
        self._scores: dict[Beam, float] = {(): 0.0}

    def row(self, beam: Beam) -> np.ndarray:
        if beam not in self._rows:
            self._rows[beam] = self.lm.next_logprobs(self.prompt + beam)
        return self._rows[beam]

    def score(self, beam: Beam) -> float:
        if beam not in self._scores:
            self._scores[beam] = self.score(beam[:-1]) + float(self.row(beam[:-1])[beam[-1]])
        return self._scores[beam]


def candidate_distribution(
    lm: TableLM,
    prompt: Sequence[int],
    beams: Sequence[Beam],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> np.ndarray:
    """``P_beam`` of one beam-sampling step as a ``[len(beams), V]`` array.

    Entry ``(i, v)`` is the probability of drawing candidate ``beams[i] + (v,)``; the table is
    ``s_i + log p(v | prompt + beams[i])`` with the true cumulative score ``s_i``, filtered
    jointly over all rows (row-major flattening, as in the engine).
    """
    cache = _ScoreCache(lm, tuple(int(t) for t in prompt))
    return _candidate_probs(cache, list(beams), temperature, top_k, top_p).reshape(
        len(beams), lm.vocab_size
    )


def _candidate_probs(
    cache: _ScoreCache, beams: list[Beam], temperature: float, top_k: int, top_p: float
) -> np.ndarray:
    table = np.concatenate([cache.score(b) + cache.row(b) for b in beams])
    return joint_filter(table, temperature, top_k, top_p)


_MULTISET_TABLES: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
_SUBSET_TABLES: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _multiset_table(m: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """All multisets of size ``r`` over ``range(m)`` (rows ascending) and their multinomial
    coefficients ``r! / prod(count!)``; cached because every state of a run reuses them."""
    if (m, r) not in _MULTISET_TABLES:
        combos = np.array(list(combinations_with_replacement(range(m), r)), dtype=np.intp)
        coef = np.array(
            [
                math.factorial(r) / math.prod(math.factorial(c) for c in Counter(row).values())
                for row in combos.tolist()
            ]
        )
        _MULTISET_TABLES[(m, r)] = (combos.reshape(-1, r), coef)
    return _MULTISET_TABLES[(m, r)]


def _subset_table(m: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All ordered draws of ``r`` distinct items from ``range(m)``, the sets of size ``r``
    (rows ascending), and for each ordered draw the row of its set; cached."""
    if (m, r) not in _SUBSET_TABLES:
        subsets = list(combinations(range(m), r))
        row_of = {s: i for i, s in enumerate(subsets)}
        orders = list(permutations(range(m), r))
        set_index = np.array([row_of[tuple(sorted(o))] for o in orders], dtype=np.intp)
        _SUBSET_TABLES[(m, r)] = (
            np.array(orders, dtype=np.intp).reshape(-1, r),
            np.array(subsets, dtype=np.intp).reshape(-1, r),
            set_index,
        )
    return _SUBSET_TABLES[(m, r)]


def _draws_with_replacement(mass: np.ndarray, n_draws: int) -> tuple[np.ndarray, np.ndarray]:
    """Multisets of ``n_draws`` i.i.d. draws from ``mass``: (index rows, probabilities)."""
    combos, coef = _multiset_table(len(mass), n_draws)
    return combos, coef * np.prod(mass[combos], axis=1)


def _draws_distinct(mass: np.ndarray, n_draws: int) -> tuple[np.ndarray, np.ndarray]:
    """Sets drawn sequentially without replacement from ``mass``: (index rows, probabilities).

    Each ordered draw has probability ``prod_t mass[j_t] / (mass left before draw t)``, where
    the mass left is summed over the not-yet-drawn items (no ``1 - sum`` cancellation); the
    orderings of one set are then added up. With fewer than ``n_draws`` items, all are taken.
    """
    n_draws = min(n_draws, len(mass))
    orders, subsets, set_index = _subset_table(len(mass), n_draws)
    not_drawn = np.ones((len(orders), len(mass)))
    prob = np.ones(len(orders))
    rows = np.arange(len(orders))
    for t in range(n_draws):
        prob *= mass[orders[:, t]] / (not_drawn @ mass)
        not_drawn[rows, orders[:, t]] = 0.0
    return subsets, np.bincount(set_index, weights=prob, minlength=len(subsets))


def beam_sampling_outcomes(
    lm: TableLM,
    prompt: Sequence[int],
    width: int,
    max_new_tokens: int,
    mode: str,
    eos: Iterable[int] = (),
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stops: Stops | None = None,
) -> dict[Outcome, float]:
    """Exact distribution of the final beam multiset of target beam sampling.

    Process (the definition the engine implements): start with one empty active beam, score 0,
    and remaining width ``R = width``. While beams are active and fewer than
    ``max_new_tokens`` steps are done: build the candidate table ``s_i + log p(v | ...)`` over
    active beams and tokens, filter it jointly (``joint_filter``), draw ``R`` candidates
    (``"with_replacement"``: i.i.d.; ``"distinct"``: sequentially without replacement, all
    candidates with mass if fewer than ``R``), extend; beams ending in an ``eos`` token (or whose
    text holds a stop string, ``stops``) join the finished pool and reduce ``R``. Scores are
    true raw cumulative log-probs, never filtered.

    Returns ``{outcome: probability}`` where an outcome is the sorted tuple of all final beams
    (finished + active, duplicates kept). Identical states (sorted active beams, sorted finished
    pool, R) are merged after each step; the cost is then about 10 us per (state, drawn
    multiset) pair, dominated by the number of outcomes: V=4, W=3, N=3 (~4e4 outcomes) < 1 s,
    V=5, W=3, N=3 (~3e5) ~3 s, V=5, W=3, N=4 with an EOS token (~6.6e6) ~1 min.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if width < 1 or max_new_tokens < 0:
        raise ValueError("need width >= 1 and max_new_tokens >= 0")
    eos_set = frozenset(int(t) for t in eos)
    cache = _ScoreCache(lm, tuple(int(t) for t in prompt))
    vocab = lm.vocab_size
    draw = _draws_with_replacement if mode == "with_replacement" else _draws_distinct

    outcomes: dict[Outcome, float] = defaultdict(float)
    if max_new_tokens == 0:
        return {((),): 1.0}
    # state = (sorted active beams, sorted finished beams, remaining width R)
    layer: dict[tuple[Outcome, Outcome, int], float] = {(((),), (), width): 1.0}
    for step in range(max_new_tokens):
        last_step = step == max_new_tokens - 1
        next_layer: dict[tuple[Outcome, Outcome, int], float] = defaultdict(float)
        for (active, finished, remaining), p_state in layer.items():
            probs = _candidate_probs(cache, list(active), temperature, top_k, top_p)
            # Candidates with mass, as (new beam, probability); identical new beams (from
            # duplicate parents, with_replacement only) are merged since only the multiset of
            # beams matters. Sorting makes every drawn index row give a sorted beam tuple.
            merged_mass: dict[Beam, float] = defaultdict(float)
            for k in np.flatnonzero(probs > 0.0):
                merged_mass[active[k // vocab] + (int(k % vocab),)] += float(probs[k])
            # Distinct mode never holds duplicate active beams, so no merge happens there (a
            # merge would be wrong for draws without replacement over candidate indices).
            assert mode == "with_replacement" or len(merged_mass) == np.count_nonzero(probs)
            new_beams = sorted(merged_mass)
            is_eos = [b[-1] in eos_set or _stopped(b, stops) for b in new_beams]
            mass = np.array([merged_mass[b] for b in new_beams])
            index_rows, draw_probs = draw(mass, remaining)
            n_done_rows = np.array(is_eos, dtype=np.intp)[index_rows].sum(axis=1)
            for row, p_draw, n_done in zip(
                index_rows.tolist(), draw_probs.tolist(), n_done_rows.tolist(), strict=True
            ):
                if p_draw <= 0.0:
                    continue
                p = p_state * p_draw
                if n_done == len(row) or last_step:
                    drawn = [new_beams[j] for j in row]
                    outcomes[tuple(sorted(finished + tuple(drawn)))] += p
                else:
                    still = tuple(new_beams[j] for j in row if not is_eos[j])
                    if n_done:
                        done = tuple(new_beams[j] for j in row if is_eos[j])
                        key = (still, tuple(sorted(finished + done)), remaining - n_done)
                    else:
                        key = (still, finished, remaining)
                    next_layer[key] += p
        layer = next_layer
    return {o: p for o, p in outcomes.items() if p > 0.0}


def best_answer(
    beams: Iterable[Beam], lm: TableLM, prompt: Sequence[int], length_penalty: float = 1.0
) -> Beam:
    """The final selection rule: highest ``s / len**length_penalty``, ties -> smaller tuple.

    ``s`` is the true raw cumulative log-prob recomputed from ``lm`` (never a filtered score);
    an empty beam (only possible with ``max_new_tokens = 0``) ranks with score 0. Scores are
    compared exactly, so near-ties are resolved by floating point like any implementation.
    """
    best: Beam | None = None
    best_key = -math.inf
    for beam in sorted(set(beams)):
        s = lm.sequence_logprob(prompt, beam)
        key = s / len(beam) ** length_penalty if beam else s
        if best is None or key > best_key:
            best, best_key = beam, key
    if best is None:
        raise ValueError("no beams to choose from")
    return best


def best_answer_distribution(
    outcomes: dict[Outcome, float],
    lm: TableLM,
    prompt: Sequence[int],
    length_penalty: float = 1.0,
) -> dict[Beam, float]:
    """Exact distribution of the returned answer, from ``beam_sampling_outcomes``."""
    answers: dict[Beam, float] = defaultdict(float)
    for outcome, p in outcomes.items():
        answers[best_answer(outcome, lm, prompt, length_penalty)] += p
    return dict(answers)


def multinomial_outcomes(
    lm: TableLM,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos: Iterable[int] = (),
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stops: Stops | None = None,
) -> dict[Beam, float]:
    """Exact distribution of plain ancestral sampling: ``{generated tokens: probability}``.

    Each token is drawn from ``joint_filter`` applied to the single next-token row; generation
    stops after an ``eos`` token, a text holding a stop string (``stops``), or ``max_new_tokens``
    tokens. Written separately from the beam
    enumerator so that "beam sampling with W = 1 is ordinary sampling" is a real check; note
    that beam sampling's outcome for W = 1 is the 1-tuple ``(tokens,)``.
    """
    eos_set = frozenset(int(t) for t in eos)
    prompt_t = tuple(int(t) for t in prompt)
    result: dict[Beam, float] = defaultdict(float)

    def recurse(tokens: Beam, p: float) -> None:
        done = tokens and (tokens[-1] in eos_set or _stopped(tokens, stops))
        if len(tokens) == max_new_tokens or done:
            result[tokens] += p
            return
        probs = joint_filter(lm.next_logprobs(prompt_t + tokens), temperature, top_k, top_p)
        for v in np.flatnonzero(probs > 0.0):
            recurse(tokens + (int(v),), p * float(probs[v]))

    recurse((), 1.0)
    return dict(result)
