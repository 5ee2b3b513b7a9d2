"""Stop strings: a beam finishes where its generated text first contains one (issue 52).

A stop string makes "finished" a function of the beam's whole generated prefix (through the
tokenizer's text), as an EOS token makes it a function of the last token. The engine asks one
question wherever it tests a token against the EOS ids: which of these sequences (a draft
node's, an accepted node's, an output slot's) finished by a stop string? `StopStrings.finished`
answers it for a batch of sequences at once, as a mask beside the EOS test, so the rule is the
EOS rule: the draft does not extend a finished node, verification finishes an accepted or filled
beam at the first token whose text holds a stop, and the beam leaves the running set there.

The text is matched as UTF-8 bytes: each token id has the bytes it adds to the text
(`TokenTexts`), and a generated text contains a stop exactly when the concatenated bytes
contain the stop's bytes (UTF-8 is self-synchronising, so a byte match is a character match).
A running beam's text holds no stop (it would have finished), so a new match ends in the last
token; it spans at most `len(stop in bytes)` tokens when every token adds at least one byte, and
only that many last tokens are read (`window`). Tokens whose text is empty (special tokens, left
out of the text) count in that window; a stop spelled across more tokens than its bytes is not
seen. The answer for each distinct window is computed once (`torch.unique` over the rows) and
memoised, so 1e5 sessions of a table model cost a handful of host lookups.

Nothing here runs without a stop string: the engine's default path is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dsbd_core.algorithm.sequences.stop_text import stop_problem

# windows whose answer a decode remembers before it starts over (a long decode's memory)
_MEMO_ENTRIES = 1 << 16


class TokenTexts(Protocol):
    """Where a stop check reads each token id's bytes: small and picklable (it travels with
    every iteration call), resolving its table where it is used."""

    def table(self) -> Sequence[bytes]:
        """The bytes each token id adds to the text (b"" for a token that adds none)."""
        ...


@dataclass(frozen=True)
class ExplicitTexts:
    """A vocabulary given token by token (table models in the tests, small vocabularies)."""

    texts: tuple[str, ...]

    def table(self) -> Sequence[bytes]:
        return [text.encode() for text in self.texts]


@dataclass
class StopStrings:
    """The stop strings of a decode and the vocabulary's bytes: which sequences finished.

    Pickles as its strings and its `TokenTexts` (the table and the memo stay behind), so it
    can ride along with every `IterationCall` to the draft and verifier replicas.
    """

    stops: tuple[str, ...]
    texts: TokenTexts
    # vLLM's min_tokens: a match in a sequence of fewer generated tokens does not finish it
    min_tokens: int = 0
    _table: Sequence[bytes] | None = field(default=None, repr=False, compare=False)
    _memo: dict[tuple, bool] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        problem = stop_problem(self.stops)
        if problem is not None or not self.stops:
            raise ValueError(f"stop: {problem or 'no stop string'}")
        self.stops = tuple(self.stops)
        self._encoded = tuple(stop.encode() for stop in self.stops)

    @property
    def window(self) -> int:
        """How many last tokens a check reads: the longest stop's length in bytes."""
        return max(len(stop) for stop in self._encoded)

    def __getstate__(self) -> dict:
        return {"stops": self.stops, "texts": self.texts, "min_tokens": self.min_tokens}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["stops"], state["texts"], state.get("min_tokens", 0))  # type: ignore[misc]  # unpickling re-runs this class's __init__

    def finished(
        self, seq: torch.Tensor, seq_len: torch.Tensor, prompt_len: torch.Tensor
    ) -> torch.Tensor:
        """Which sequences' generated text holds a stop: `seq` [B, n, L] token ids, each
        session's sequences `seq_len` [B] long (prompt included) after `prompt_len` [B]
        prompt tokens. Returns [B, n] bool on `seq`'s device. Valid where a sequence's text
        without its last token holds none, or held one before `min_tokens` generated tokens
        (every sequence the engine asks about); none counts before `min_tokens`."""
        batch, n, capacity = seq.shape
        k = self.window
        pos = seq_len[:, None] - k + torch.arange(k, device=seq.device)  # [B, k]
        generated = (pos >= prompt_len[:, None]) & (pos >= 0)
        index = pos.clamp(0, capacity - 1)[:, None, :].expand(batch, n, k)
        window = torch.where(generated[:, None, :], seq.gather(2, index), -1).reshape(-1, k)
        rows, inverse = torch.unique(window, dim=0, return_inverse=True)
        hits = [self._holds_stop(tuple(row)) for row in rows.tolist()]
        found = torch.tensor(hits, dtype=torch.bool, device=seq.device)
        found = found[inverse].view(batch, n)
        if self.min_tokens:
            found = found & (seq_len - prompt_len >= self.min_tokens)[:, None]
        return found

    def _holds_stop(self, window: tuple[int, ...]) -> bool:
        """Whether the text of these token ids (-1: none) holds a stop string (memoised). With
        `min_tokens`, only a match that ends in the last token's bytes counts: a stop the
        text held before min_tokens was ignored then, and stays ignored (vLLM)."""
        ending = self.min_tokens > 0
        key = (ending, *window)  # copies with another min_tokens share the memo
        hit = self._memo.get(key)
        if hit is None:
            if self._table is None:
                self._table = self.texts.table()
            table = self._table
            text = b"".join(table[t] for t in window if 0 <= t < len(table))
            last = window[-1] if window else -1
            tail = len(table[last]) if 0 <= last < len(table) else 0
            # a match ending in the last token's bytes starts at or after len - tail - len + 1
            hit = any(
                stop in (text[max(0, len(text) - tail - len(stop) + 1) :] if ending else text)
                for stop in self._encoded
            )
            if len(self._memo) >= _MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = hit
        return hit
