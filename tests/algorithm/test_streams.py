"""The draws' source: murmur3 of the draw's counters, the same on every device and layout.

Known answers come from the reference MurmurHash3 (`mmh3`, the C implementation) over the nine
words packed little-endian, and from numbers written down here, so the definition cannot drift
with the code; the exactness tests (`test_exactness*.py`) check the laws with this source.
"""

from __future__ import annotations

import random
import struct

import mmh3
import pytest
import torch

from dsbd_core.algorithm.draws.murmur import MASK, absorb, finish, hash_words
from dsbd_core.algorithm.draws.streams import (
    ACCEPT,
    BONUS,
    DRAFT,
    VERIFY_SIDE,
    WORDS,
    Draws,
    Streams,
    hash_uniforms,
)


def _reference_words(
    seed: int, iteration: int, side: int, level: int, purpose: int, call: int, row: int, i: int
) -> int:
    words = [seed & MASK, seed >> 32, iteration, side, level, purpose, call, row, i]
    return mmh3.hash(struct.pack("<9I", *words), 0, signed=False)


def test_the_hash_is_murmur3_on_ints_and_tensors() -> None:
    rng = random.Random(0)
    for n in range(10):
        for _ in range(50):
            words = [rng.getrandbits(32) for _ in range(n)]
            seed = rng.getrandbits(32)
            packed = struct.pack(f"<{n}I", *words)
            assert hash_words(words, seed) == mmh3.hash(packed, seed, signed=False)
    words = torch.tensor([[rng.getrandbits(32) for _ in range(4)] for _ in range(64)])
    state = torch.zeros(64, dtype=torch.int64)
    for j in range(4):
        state = absorb(state, words[:, j])
    expected = [mmh3.hash(struct.pack("<4I", *row), 0, signed=False) for row in words.tolist()]
    assert finish(state, 4).tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_uniform_is_the_hash_of_its_nine_counters(dtype: torch.dtype) -> None:
    seed, iteration, level, call = 2**40 + 12345, 7, 3, 1
    draws = Streams.side(seed, iteration, VERIFY_SIDE).at(level, ACCEPT)
    draws.uniform((1, 1), dtype, torch.device("cpu"))  # call 0
    u = draws.uniform((2, 5), dtype, torch.device("cpu"))  # call 1
    for row in range(2):
        for col in range(5):
            if dtype == torch.float32:
                h = _reference_words(seed, iteration, VERIFY_SIDE, level, ACCEPT, call, row, col)
                want = ((h >> 9) * 2 + 1) * 2.0**-24
            else:
                args = (seed, iteration, VERIFY_SIDE, level, ACCEPT, call, row)
                high, low = (_reference_words(*args, 2 * col + k) for k in (0, 1))
                want = (((high >> 6) << 26 | (low >> 6)) * 2 + 1) * 2.0**-53
            assert float(u[row, col]) == want, (row, col)


def test_known_answers() -> None:
    """Written down once (murmur3 of the counters): any change of the definition shows here."""
    draws = Streams.side(12345, 7, 2).at(3, 1)
    u64 = draws.uniform((2, 3), torch.float64, torch.device("cpu"))
    assert u64.tolist() == [
        [0.7022482887314859, 0.37794850522180046, 0.2886681880338692],
        [0.8100170642039247, 0.24736632395054625, 0.9011884551465624],
    ]
    u32 = Streams.side(12345, 7, 2).at(3, 1).uniform((2, 3), torch.float32, torch.device("cpu"))
    assert u32.tolist() == [
        [0.7022482752799988, 0.9027140736579895, 0.37794846296310425],
        [0.8100170493125916, 0.9993404746055603, 0.24736636877059937],
    ]
    assert WORDS == 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniforms_lie_strictly_inside_the_unit_interval(dtype: torch.dtype) -> None:
    words = 2 if dtype == torch.float64 else 1
    for value in (0, MASK):  # the extreme hashes: never 0.0, never 1.0
        u = hash_uniforms(torch.full((1, 1, words), value, dtype=torch.int64), dtype)
        assert 0.0 < float(u) < 1.0, (value, float(u))
    u = Draws.seeded(3).uniform((1000, 100), dtype, torch.device("cpu"))
    assert u.dtype == dtype and bool((u > 0).all() & (u < 1).all())


def test_the_numbers_look_uniform_and_independent() -> None:
    """A sanity check of the source, beside the exactness tests that judge the laws: moments,
    a 64-bin histogram, and no correlation between neighbouring indices or sessions."""
    u = Draws.seeded(11).uniform((1000, 1000), torch.float64, torch.device("cpu"))
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 5 * (1 / 12 / n) ** 0.5
    assert abs(float(u.var()) - 1 / 12) < 0.002
    counts = torch.histc(u, bins=64, min=0, max=1)
    chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 120, chi2  # 63 degrees of freedom: p ~ 3e-5
    c = u - 0.5
    for a, b in ((c[:, 1:], c[:, :-1]), (c[1:], c[:-1])):
        corr = float((a * b).mean() / (c * c).mean())
        assert abs(corr) < 5 / (a.numel() ** 0.5), corr


def test_a_draw_depends_on_its_counters_only() -> None:
    """Padding rows or columns, chunking the sessions, the key as a tensor (a graph's input)
    and which other streams ran: none moves a number."""
    cpu = torch.device("cpu")
    streams = Streams.side(99, 4, VERIFY_SIDE)
    whole = streams.at(2, BONUS).uniform((6, 8), torch.float64, cpu)
    padded = streams.at(2, BONUS).uniform((9, 13), torch.float64, cpu)
    assert torch.equal(padded[:6, :8], whole)
    chunked = streams.at(2, BONUS)
    parts = [chunked.rows_from(i).uniform((2, 8), torch.float64, cpu) for i in (0, 2, 4)]
    assert torch.equal(torch.cat(parts), whole)
    keyed = streams.on(cpu).at(2, BONUS).uniform((6, 8), torch.float64, cpu)
    assert torch.equal(keyed, whole)
    other = Streams.side(99, 4, VERIFY_SIDE)
    other.at(1, ACCEPT).uniform((6, 8), torch.float64, cpu)  # a draw before it, or not
    assert torch.equal(other.at(2, BONUS).uniform((6, 8), torch.float64, cpu), whole)
    # and every counter matters
    for different in (
        Streams.side(98, 4, VERIFY_SIDE).at(2, BONUS),
        Streams.side(99, 5, VERIFY_SIDE).at(2, BONUS),
        Streams.side(99, 4, 1).at(2, BONUS),
        Streams.side(99, 4, VERIFY_SIDE).at(3, BONUS),
        Streams.side(99, 4, VERIFY_SIDE).at(2, DRAFT),
    ):
        assert not torch.equal(different.uniform((6, 8), torch.float64, cpu), whole)


def test_a_compiled_draw_equals_the_eager_one() -> None:
    """The hash traces into a graph (`fullgraph=True`) with the key as an input, and one
    compiled graph serves every key."""
    torch._dynamo.reset()
    cpu = torch.device("cpu")

    def draw(streams: Streams) -> torch.Tensor:
        return streams.at(1, BONUS).uniform((3, 7), torch.float64, cpu)

    compiled = torch.compile(draw, fullgraph=True, backend="eager", dynamic=False)
    for iteration in range(3):
        streams = Streams.side(5, iteration, VERIFY_SIDE)
        assert torch.equal(compiled(streams.on(cpu)), draw(streams))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_draws_the_cpus_numbers() -> None:
    streams = Streams.side(2**50 + 3, 11, VERIFY_SIDE)
    for dtype in (torch.float32, torch.float64):
        cpu = streams.at(1, ACCEPT).uniform((17, 33), dtype, torch.device("cpu"))
        gpu = streams.on(torch.device("cuda")).at(1, ACCEPT).uniform((17, 33), dtype, "cuda")
        assert torch.equal(gpu.cpu(), cpu)
