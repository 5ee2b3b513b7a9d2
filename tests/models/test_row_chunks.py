"""A session's forward batched with others gives the bits of its forward alone (bfloat16, CPU).

The served decode of a seeded request must equal the in-process one whatever it is batched with
(issue 21). The scorer attends each session alone (`packed_forward`) and `RowChunkedLinear`
computes each session's linear rows in the size class its forward alone uses: bit identity is
what is asserted, on the real SmolLM2 pair in bfloat16 (the serving default on AMX CPUs), with
sessions of every shape: short and long prompts (large forwards of more than 32 rows), one and
three roots, packed and dense forwards. The row classes were measured on oneDNN's AMX-BF16
kernels; on a CPU without AMX-BF16 the bit-identity tests are skipped (other kernels, other
classes: not measured).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsbd_core.algorithm.scorer import ForestLayer, Roots
from dsbd_core.models.row_chunks import (
    ROW_CHUNK,
    RowChunkedLinear,
    RowGroup,
    RowLayout,
    chunk_linear_rows,
    rows_as_alone,
)
from dsbd_core.models.transformer_scorer import TransformerScorer
from tests.support.cpu import needs_amx


def _linear(features: int = 576, out: int = 1536) -> RowChunkedLinear:
    torch.manual_seed(0)
    linear = nn.Linear(features, out, bias=False).to(torch.bfloat16)
    chunk_linear_rows(linear)
    assert isinstance(linear, RowChunkedLinear)
    return linear


@needs_amx
def test_every_group_gets_the_bits_of_its_call_alone() -> None:
    """Small groups share 32-row calls, large ones (and a dense one padded past 32 rows alone)
    get calls of their own: each group's rows equal the layer run on that group alone."""
    linear = _linear()
    groups = (
        RowGroup(5, 5),
        RowGroup(40, 40),
        RowGroup(20, 20),
        RowGroup(12, 36),
        RowGroup(31, 31),
        RowGroup(1, 1),
        RowGroup(70, 70),
        RowGroup(9, 9),
    )
    total = sum(g.rows for g in groups)
    x = (torch.randn(total, 576) * 3).to(torch.bfloat16)
    with torch.inference_mode():
        with rows_as_alone(RowLayout(groups, groups)):
            batched = linear(x[None])[0]
        plain = linear(x)  # one call over every row: not what the groups get alone
        start = 0
        for group in groups:
            rows = x[start : start + group.rows]
            alone_input = torch.cat([rows, rows.new_zeros(group.alone - group.rows, 576)])
            alone = linear(alone_input)[: group.rows]  # the group's forward alone: its own call
            assert torch.equal(batched[start : start + group.rows], alone), group
            start += group.rows
    assert total > ROW_CHUNK and not torch.equal(batched, plain)  # the chunking did something


def test_outside_a_batched_forward_it_is_the_layer_it_replaced() -> None:
    """No layout: the same outputs as `nn.Linear` (float32 bit for bit; bfloat16 through the
    prepacked weight within rounding), gradients flow, and a changed weight is used."""
    torch.manual_seed(0)
    plain = nn.Linear(64, 48)
    chunked = nn.Linear(64, 48)
    chunked.load_state_dict(plain.state_dict())
    assert chunk_linear_rows(chunked) == 1 and chunk_linear_rows(chunked) == 0  # idempotent
    x = torch.randn(7, 64, requires_grad=True)
    assert torch.equal(chunked(x), plain(x))
    chunked(x).sum().backward()
    assert x.grad is not None and chunked.weight.grad is not None
    bf_plain, bf_chunked = plain.to(torch.bfloat16), chunked.to(torch.bfloat16)
    xb = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        before = bf_chunked(xb)
        torch.testing.assert_close(before, bf_plain(xb), atol=0.05, rtol=0.02)
        bf_chunked.weight.mul_(2)  # e.g. a draft trained further in the same process
        after = bf_chunked(xb)
        torch.testing.assert_close(
            after,
            torch.nn.functional.linear(xb, bf_chunked.weight, bf_chunked.bias),
            atol=0.05,
            rtol=0.02,
        )
        assert not torch.allclose(after, before, atol=0.05, rtol=0.02)
    assert set(bf_chunked.state_dict()) == {"weight", "bias"}


def _roots(prompts: list[list[int]], width: int) -> Roots:
    length = max(map(len, prompts))
    tokens = torch.zeros(len(prompts), width, length, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        tokens[i, :, : len(prompt)] = torch.tensor(prompt)
    alive = torch.ones(len(prompts), width, dtype=torch.bool)
    return Roots(tokens, torch.tensor([len(p) for p in prompts]), alive, None)


def _layer(sessions: int, width: int, seed: int) -> ForestLayer:
    generator = torch.Generator().manual_seed(seed)
    parent = torch.randint(0, width, (sessions, 4), generator=generator)
    token = torch.randint(0, 1000, (sessions, 4), generator=generator)
    return ForestLayer(parent, token, torch.ones(sessions, 4, dtype=torch.bool))


@needs_amx
@pytest.mark.real_model
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.slow  # over a second: outside the quick loop
def test_a_batched_forward_gives_each_session_its_bits_alone(pack: bool, width: int) -> None:
    from dsbd_core.models.loading import load_causal_lm

    model = load_causal_lm("smollm2", dtype=torch.bfloat16).model
    prompts = [list(range(100, 145)), [44, 57, 70], list(range(300, 320)), list(range(7, 50))]
    layers = [_layer(len(prompts), width, seed) for seed in (0, 1)]
    batched = TransformerScorer(model, pack=pack)
    batched.set_roots(_roots(prompts, width))
    together = [batched.forward([layer]) for layer in layers]
    for i, prompt in enumerate(prompts):
        alone = TransformerScorer(model, pack=pack)
        alone.set_roots(_roots([prompt], width))
        for depth, layer in enumerate(layers):
            own = ForestLayer(
                layer.parent[i : i + 1], layer.token[i : i + 1], layer.exists[i : i + 1]
            )
            out = alone.forward([own])
            if depth == 0:
                assert out.roots is not None and together[0].roots is not None
                assert torch.equal(out.roots[0], together[0].roots[i]), (i, "roots")
            assert torch.equal(out.layers[0][0], together[depth].layers[0][i]), (i, depth)
