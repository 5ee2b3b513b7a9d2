"""The int8 draft's linear layers: each row's output depends on that row alone (batch-invariant:
every row is quantised on its own scale and integer sums are exact), close to the float layer.

`torch.ao` dynamic quantisation scaled each call's input by its whole-batch range, so a seeded
request's draft depended on its batch mates (benchmarks/investigations/batch_invariance/ at
commit 637ed2c: 0/16 equal); `RowScaledInt8Linear` scales every row by its own range (and is far
more precise for rows much smaller than their batch mates).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsbd_core.models.draft_variants import use_int8_engine
from dsbd_core.models.row_int8 import RowScaledInt8Linear, quantize_linears
from tests.support.cpu import AMX


@pytest.fixture(autouse=True)
def _int8_engine() -> None:
    use_int8_engine()  # the engine the draft runs on (oneDNN with AMX-INT8, else x86)


@pytest.mark.skipif(not AMX, reason="measured on oneDNN's AMX-INT8 kernels only")
@pytest.mark.parametrize(("features", "out"), [(576, 192), (1536, 576)])
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(features: int, out: int) -> None:
    """Shapes of the drafts' layers (inputs >= 256; layers of 64-128 inputs take another
    oneDNN path, where this does not hold: no draft here has one)."""
    torch.manual_seed(0)
    linear = RowScaledInt8Linear(nn.Linear(features, out))
    x = torch.randn(300, features) * torch.logspace(-2, 1, 300)[:, None]  # rows of all ranges
    with torch.inference_mode():
        alone = torch.cat([linear(x[i : i + 1]) for i in range(300)])
        for count in (2, 16, 17, 33, 64, 65, 128, 300):
            assert torch.equal(linear(x[:count]), alone[:count]), count
        batched = linear(x.view(30, 10, features)).view(300, out)  # any leading shape
        assert torch.equal(batched, alone)
        assert torch.equal(linear(torch.zeros(3, features)), linear.bias.expand(3, out))


def test_it_stays_close_to_the_float_layer() -> None:
    torch.manual_seed(1)
    float_layer = nn.Linear(256, 64)
    x = torch.randn(16, 256)
    with torch.inference_mode():
        want, got = float_layer(x), RowScaledInt8Linear(float_layer)(x)
    error = (got - want).norm() / want.norm()
    assert error < 0.02, error  # int8 weights and activations: ~1 % relative error


def test_quantize_linears_replaces_every_plain_linear_in_place() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False)))
    assert quantize_linears(model) == 2
    assert isinstance(model[0], RowScaledInt8Linear)
    assert isinstance(model[2][0], RowScaledInt8Linear)
    assert model[2][0].bias is None and quantize_linears(model) == 0
    assert model(torch.randn(5, 8)).shape == (5, 4)
