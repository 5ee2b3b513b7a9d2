"""The prompt-lookup draft's name and the bounds of its n-gram length, with no torch import:
a Serve application's builder, `dsbd serve`'s config check and the CLI's flags read them without
loading the draft (dsbd_core/algorithm/scorers/ngram_draft.py)."""

from __future__ import annotations

NGRAM_DEFAULT = 3  # transformers' max_matching_ngram_size is 2, vLLM's prompt_lookup_max 5
NGRAM_MIN = 1
NGRAM_MAX = 16
LOOKUP_DRAFT = "ngram"  # what `draft:` / `--draft` name it


def ngram_max_problem(value: object) -> str | None:
    """What is wrong with `value` as an n-gram bound (what is allowed), or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"allowed an integer {NGRAM_MIN}..{NGRAM_MAX}"
    if not NGRAM_MIN <= value <= NGRAM_MAX:
        return f"allowed {NGRAM_MIN}..{NGRAM_MAX}"
    return None


def check_ngram_max(value: int, field: str = "ngram_max") -> int:
    """`value` if it is an allowed n-gram bound, else a ValueError naming the field, the value
    and what is allowed (`field`: how the caller's input spells it)."""
    problem = ngram_max_problem(value)
    if problem is not None:
        raise ValueError(f"{field}={value!r}: {problem}")
    return value


def describe_lookup(ngram_max: int) -> str:
    """The draft in words, as entry points print and record it."""
    return f"prompt lookup, n-grams up to {ngram_max}"
