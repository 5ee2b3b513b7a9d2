"""The verifier's random streams: one per (forest layer, purpose) of an iteration.

Verification draws for four purposes per layer: the bonus slots of sessions past their depth,
the acceptance uniforms, the fill of a failed layer and the refill of a layer whose accepted
beams all finished. On the host the engine skips a draw no session of the batch needs (reading
a mask costs nothing there); on a device it draws every time and selects with `where`, since
learning that nobody needs the draw would wait for the device (`host_reads.py`). With one
stream for the whole side, a skipped draw would move every later one, and the two placements
would decode different tokens for the same seed. With one stream per (layer, purpose), seeded
from the side's seed, a draw takes the same numbers whether or not the draws before it ran, so
the host and the device decode the same tokens, and a seeded decode stays reproducible.

The first layer's bonus stream is the side's own seed: a beam-sampling or sampling step (no
drafted layer) draws only there, from the stream it always had.
"""

from __future__ import annotations

import torch

from dsbd_core.algorithm.distributions import Source

# What a draw of a verified layer is for (the order of the draws within a layer: bonus, width,
# acceptance, fill, refill). WIDTH: the dynamic width's simulated layers (`width_distinct`).
BONUS, ACCEPT, FILL, REFILL, WIDTH = 0, 1, 2, 3, 4
_MASK = 2**63 - 1


def side_seed(seed: int, iteration: int, side: int) -> int:
    """The seed of one side's draws (`DRAFT_STREAM` or `VERIFY_STREAM`) in one iteration.

    Draft and verifier may live in different processes; deriving each side's stream from
    (decode seed, iteration, side) instead of sharing one generator makes a distributed decode
    draw exactly what the in-process engine draws for the same seed."""
    return (seed * 1_000_003 + iteration * 4 + side) % _MASK


class Streams:
    """Hands out the generator seeded for a (layer, purpose) of one iteration's verify side."""

    def __init__(self, generator: torch.Generator, seed: int) -> None:
        self.generator = generator
        self.seed = seed  # the side's seed (`Engine._reseed`)

    def at(self, level: int, purpose: int) -> Source:
        """The generator, seeded for layer `level`'s draws for `purpose` (use it before the
        next `at`: there is one generator)."""
        self.generator.manual_seed(stream_seed(self.seed, level, purpose))
        return self.generator


class Recording(Streams):
    """`Streams` that also keeps every number it hands out, by (layer, purpose), in order:
    the numbers a `Recorded` replays."""

    def __init__(self, generator: torch.Generator, seed: int) -> None:
        super().__init__(generator, seed)
        self.tape: dict[tuple[int, int], list[torch.Tensor]] = {}

    def at(self, level: int, purpose: int) -> Source:
        generator = super().at(level, purpose)
        return _Taping(generator, self.tape.setdefault((level, purpose), []))


class Recorded:
    """The numbers of a `Recording`, handed out again in the same order: a source without a
    generator, which a compiled step (`torch.compile(fullgraph=True)` cannot take a
    `torch.Generator`) or a captured one (its noise drawn before the replay) draws from."""

    def __init__(self, tape: dict[tuple[int, int], list[torch.Tensor]]) -> None:
        self.tape = tape

    def at(self, level: int, purpose: int) -> Source:
        return _Replaying(self.tape.get((level, purpose), []))


class _Taping:
    def __init__(self, generator: torch.Generator, into: list[torch.Tensor]) -> None:
        self.generator, self.into = generator, into

    def uniform(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        drawn = torch.rand(shape, generator=self.generator, dtype=dtype, device=device)
        self.into.append(drawn.clone())
        return drawn


class _Replaying:
    def __init__(self, tape: list[torch.Tensor]) -> None:
        self.tape, self.next = tape, 0

    def uniform(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        drawn = self.tape[self.next]
        self.next += 1
        assert drawn.shape == shape and drawn.dtype == dtype, "replayed out of order"
        return drawn


def stream_seed(seed: int, level: int, purpose: int) -> int:
    """A seed per (side seed, layer, purpose): the side's own for the first layer's bonus,
    else a 64-bit mix of the three (splitmix64's finaliser), so that no two streams of a
    decode share their numbers."""
    if (level, purpose) == (1, BONUS):
        return seed
    stream = level * 4 + purpose + 1 if purpose < WIDTH else (1 << 32) + level
    z = (seed + 0x9E3779B97F4A7C15 * stream) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK


LayerStreams = Streams | Recorded  # what verification draws from
