"""Every random number of a decode, as a hash of its counters: no generator, no state.

A uniform is murmur3 (`murmur.py`) of nine 32-bit words: the decode's seed (two words), the
iteration, the side (draft or verifier), the forest layer, the purpose (a draft layer, or the
verifier's bonus, acceptance, fill, refill and width draws), the draw within that (layer,
purpose), the session (the row of the batch) and the index within the row (for a candidate
table, the candidate's flat index parent * V + token). Because a draw is a function of what it
is for and nothing else:

* a skipped draw moves no other: the host skips what no session needs (reading a mask costs
  nothing there), a device computes everything and selects with `where`, and both decode the
  same tokens for the same seed;
* padding rows, bucket sizes and chunking move no draw (a draw is keyed by its session and
  index, not by where it sits in memory);
* the host, a compiled graph and a GPU draw the same numbers: the words are integer tensor ops
  that mean the same on every device, and a graph takes the side's key as a tensor input
  (`Streams.on`), so one capture serves every iteration;
* draft and verifier may live in different processes: each derives its side's numbers from
  (seed, iteration, side) alone.

Uniforms lie strictly inside (0, 1): float64 ones carry 52 random bits, (2k + 1) / 2^53; float32
ones 23, (2k + 1) / 2^24 (a hash of 2^32 - 1 mapped to 1.0 would force an impossible token).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import torch

from dsbd_core.algorithm.draws.murmur import MASK, Word, absorb, absorb_scrambled, finish, scramble

# What a draw of a verified layer is for (the order of the draws within a layer: bonus, width,
# acceptance, fill, refill). WIDTH: the dynamic width's simulated layers (`width_distinct`).
# DRAFT: the draft side's draws of a layer.
BONUS, ACCEPT, FILL, REFILL, WIDTH, DRAFT = 0, 1, 2, 3, 4, 5
# The two sides of an iteration.
DRAFT_SIDE, VERIFY_SIDE = 1, 2
WORDS = 9  # seed (2), iteration, side, layer, purpose, draw, session, index


class Uniforms(Protocol):
    """Where a draw takes its uniform numbers from (`Draws`, or a test's stand-in)."""

    def uniform(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


def side_key(seed: int, iteration: int, side: int) -> int:
    """The hash state after (seed, iteration, side): what one side of one iteration draws from.
    The seed enters as two words (it is taken mod 2^64)."""
    state = absorb(absorb(0, seed & MASK), (seed >> 32) & MASK)
    return absorb(absorb(state, iteration & MASK), side)


class Streams:
    """One side of one iteration: hands out the draws of a (layer, purpose)."""

    def __init__(self, key: int | torch.Tensor) -> None:
        # `side_key`: a Python int on the host, a 0-d int64 tensor in a graph (Any: murmur's
        # functions take either, and mix them)
        self.key: Any = key

    @classmethod
    def side(cls, seed: int, iteration: int, side: int) -> Streams:
        """The streams of `side` in `iteration` of a decode seeded `seed`."""
        return cls(side_key(seed, iteration, side))

    def on(self, device: torch.device) -> Streams:
        """The same streams with the key as a tensor on `device`: a compiled graph takes it as
        an input instead of baking the number in (which would compile again every iteration)."""
        return Streams(torch.tensor(self.key, dtype=torch.int64, device=device))

    def at(self, level: int, purpose: int) -> Draws:
        """The draws of layer `level` for `purpose`."""
        return Draws(absorb(absorb(self.key, level), purpose))


class Draws:
    """The draws of one (layer, purpose), in order: the k-th `uniform` call is draw k. Rows are
    sessions, counted from `first_row`."""

    def __init__(self, key: int | torch.Tensor, first_row: int = 0, calls: int = 0) -> None:
        self.key: Any = key  # as Streams.key
        self.first_row, self.calls = first_row, calls

    @classmethod
    def seeded(cls, seed: int) -> Draws:
        """Draws of their own for a tool or a test that samples outside a decode (side 0,
        which no decode uses)."""
        return Streams.side(seed, 0, 0).at(0, 0)

    def uniform(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Uniforms in (0, 1) of `shape`: row i is session first_row + i, the other dimensions
        flattened are the index within the row."""
        key = absorb(self.key, self.calls)
        self.calls += 1
        return counter_uniforms(key, shape, dtype, device, self.first_row)

    def on(self, device: torch.device) -> Draws:
        """These draws with the key as a tensor on `device` (a compiled graph's input)."""
        return Draws(
            torch.tensor(self.key, dtype=torch.int64, device=device), self.first_row, self.calls
        )

    def rows_from(self, first_row: int) -> Draws:
        """These draws for the rows from `first_row` on: a batch drawn in chunks draws what it
        draws in one call (use either the chunks or the whole, not both)."""
        return Draws(self.key, self.first_row + first_row, self.calls)


def counter_uniforms(
    key: Word,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    first_row: int = 0,
) -> torch.Tensor:
    """murmur3 of (key's words, session, index) for every element of `shape`, as uniforms."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype={dtype}: uniforms are float32 or float64")
    rows = shape[0] if shape else 1
    cols = math.prod(shape[1:])
    words = 2 if dtype == torch.float64 else 1  # 52 random bits need two hashes
    if isinstance(key, int) and torch.device(device).type == "cpu":
        return torch.from_numpy(_host_uniforms(key, rows, cols, words, first_row)).reshape(shape)
    row = torch.arange(first_row, first_row + rows, dtype=torch.int64, device=device)
    index = torch.arange(cols * words, dtype=torch.int64, device=device)
    state = absorb(key, row)[:, None]  # type: ignore[type-var, index]  # int key, tensor row
    h = finish(absorb_scrambled(state, scramble(index)[None, :]), WORDS)
    return hash_uniforms(h.view(rows, cols, words), dtype).reshape(shape)


def _host_uniforms(key: int, rows: int, cols: int, words: int, first_row: int) -> np.ndarray:
    """`counter_uniforms` on the host: the same words as uint32 numpy arrays, whose arithmetic
    is mod 2^32 as murmur3's is (a handful of array operations where the int64 tensor path
    takes ~50 small ones, each a few microseconds on the CPU)."""
    row = np.arange(first_row, first_row + rows, dtype=np.uint32)
    index = np.arange(cols * words, dtype=np.uint32)
    state = absorb(key, row)[:, None]  # type: ignore[type-var, index]  # int key, array row
    h = finish(absorb_scrambled(state, scramble(index)[None, :]), WORDS).reshape(rows, cols, words)
    if words == 2:
        high, low = (h[..., k].astype(np.uint64) >> np.uint64(6) for k in (0, 1))
        bits = (high << np.uint64(26)) | low
        return (bits * np.uint64(2) + np.uint64(1)).astype(np.float64) * 2.0**-53
    return ((h[..., 0] >> np.uint32(9)) * np.uint32(2) + np.uint32(1)).astype(
        np.float32
    ) * np.float32(2.0**-24)


def hash_uniforms(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uniforms from hashes (the last dimension: 2 words for float64, 1 for float32): odd
    multiples of 2^-53 (52 bits: 26 of each word) or of 2^-24 (23 bits), so strictly inside
    (0, 1) and exact in their dtype."""
    if dtype == torch.float64:
        bits = ((h[..., 0] >> 6) << 26) | (h[..., 1] >> 6)
        return (bits * 2 + 1).to(torch.float64) * 2.0**-53
    return ((h[..., 0] >> 9) * 2 + 1).to(torch.float32) * 2.0**-24
