"""MurmurHash3 (x86, 32-bit) over 32-bit words, in integer arithmetic that means the same on
every device: the hash behind every random draw of the engine (`streams.py`).

A draw is a hash of its counters (seed, iteration, side, layer, purpose, draw, session, index),
not the next output of a generator, so it depends on nothing that ran before it, on no batch
layout and on no device: a compiled or captured step computes its own noise from a key tensor,
and the host and a GPU draw the same numbers (vLLM's stateless sampler keys its noise the same
way: request seed, position, token id).

Words are held in int64 tensors (or Python ints) with values in [0, 2^32). Every product is
kept below 2^63 (a multiplier of 2^31 or more is split: x * c = x * (c - 2^31) + (x & 1) << 31
mod 2^32), so nothing relies on how a backend wraps a signed overflow: +, *, &, ^, <<, >> on
non-negative int64 values are exact on the CPU, in CUDA and in Triton alike. The same functions
take Python ints, which is how the host derives a stream's scalar key without a tensor op.
`mmh3.hash(bytes, 0, signed=False)` of the words packed little-endian is the reference
(tests/algorithm/test_streams.py).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

# numpy uint32 arrays too: the host path of streams.counter_uniforms
Word = TypeVar("Word", int, torch.Tensor, np.ndarray)

MASK = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35


def mul(x: Word, constant: int) -> Word:
    """x * constant mod 2^32, every intermediate below 2^63."""
    if constant < 2**31:
        return (x * constant) & MASK
    return (x * (constant - 2**31) + ((x & 1) << 31)) & MASK


def rotl(x: Word, r: int) -> Word:
    """x rotated left by r bits within 32."""
    return ((x << r) & MASK) | (x >> (32 - r))


def scramble(word: Word) -> Word:
    """A word's block mix before it enters the state (murmur3's k1 steps)."""
    return mul(rotl(mul(word, _C1), 15), _C2)


def absorb_scrambled(state: Word, scrambled: Word) -> Word:
    """The state after one scrambled word (murmur3's h1 steps)."""
    h = rotl(state ^ scrambled, 13)
    return (h * 5 + 0xE6546B64) & MASK


def absorb(state: Word, word: Word) -> Word:
    """The state after one more 32-bit word."""
    return absorb_scrambled(state, scramble(word))


def finish(state: Word, words: int) -> Word:
    """The hash of `words` absorbed words (murmur3's length step and finaliser)."""
    h = state ^ (4 * words)
    h = mul(h ^ (h >> 16), _F1)
    h = mul(h ^ (h >> 13), _F2)
    return h ^ (h >> 16)


def hash_words(words: list[int], seed: int = 0) -> int:
    """murmur3_32 of the words packed little-endian, with `seed`: the scalar path, and the
    definition the tensor paths must match."""
    state = seed
    for word in words:
        state = absorb(state, word & MASK)
    return finish(state, len(words))
