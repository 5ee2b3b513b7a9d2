"""Stop strings as text: their limits, what is wrong with a list of them, and where a finished
beam's returned text is cut (the engine's rule on token ids is `stops.StopStrings`).

No torch here: the request schema (deployments/api/stop_fields.py), the CLI's checks and the
text a stream returns read these rules in processes that never decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# vLLM leaves both open; these bound the per-check window and the host work.
MAX_STOPS = 16
MAX_STOP_CHARS = 256


def stop_problem(stops: Sequence[str]) -> str | None:
    """What is wrong with a list of stop strings (None: nothing), in the words an error
    message gives the field `stop`: the value and what is allowed."""
    if len(stops) > MAX_STOPS:
        return f"{len(stops)} stop strings; allowed: at most {MAX_STOPS}"
    for i, stop in enumerate(stops):
        if not isinstance(stop, str) or not stop:
            return (
                f"stop[{i}]={stop!r} is empty; allowed: strings of 1..{MAX_STOP_CHARS} characters"
            )
        if len(stop) > MAX_STOP_CHARS:
            return (
                f"stop[{i}] is {len(stop)} characters; allowed: at most {MAX_STOP_CHARS} characters"
            )
    return None


def first_stop(text: str, stops: Sequence[str], after: int = 0) -> tuple[int, str] | None:
    """Where the earliest stop string starts in `text` and which one (the longest of those
    starting there), or None: where a finished beam's returned text is cut. `after`: only a
    match ending past that many characters counts (the text of the first min_tokens - 1
    tokens, where a match was ignored, `text_floor`)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, after - len(stop) + 1))
        if at < 0:
            continue
        if best is None or at < best[0] or (at == best[0] and len(stop) > len(best[1])):
            best = (at, stop)
    return best


def text_floor(decode: Callable[[list[int]], str], ids: list[int], min_tokens: int) -> int:
    """How many characters of a beam's text no stop match may end within: those of its first
    min_tokens - 1 tokens (a match ending there came before min_tokens and was ignored)."""
    if min_tokens <= 1 or not ids:
        return 0
    return len(decode(ids[: min_tokens - 1]))


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many last characters of a growing text a stream must hold back: the longest
    suffix that begins some stop string (a later match starting there would cut it)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
