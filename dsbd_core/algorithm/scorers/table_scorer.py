"""An exact n-gram "model" behind the ForestScorer interface.

Its next-token distribution depends only on the last `order - 1` tokens, so exact output
distributions can be enumerated. The engine runs 1e5 sessions against it in one batched call:
that is what makes the statistical exactness tests (and the theory simulations) cheap. It has no
cache to compact: it just tracks each node's context.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots


class TableScorer:
    """Next-token log-probabilities from a table `logp` of shape [V] * order.

    `logp[c_1, ..., c_{order-1}, v]` = log p(v | last tokens c). Rows must be normalised log
    distributions (`-inf` for zero probability). `device`: where the table lives and an
    in-process decode keeps its state (`engine_device`): the same log-probs on every device,
    which is how a GPU is checked to decode the CPU's tokens.
    """

    def __init__(self, logp: torch.Tensor, device: torch.device | str = "cpu") -> None:
        if logp.dim() < 1 or any(s != logp.shape[-1] for s in logp.shape):
            raise ValueError(f"logp must have shape [V] * order, got {tuple(logp.shape)}")
        self.order = logp.dim()
        self._vocab = logp.shape[-1]
        self.rows = logp.reshape(-1, self._vocab).to(device=device, dtype=torch.float64)
        self.forward_calls = 0
        self._contexts: list[torch.Tensor] = []
        self._roots_pending = False

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def engine_device(self) -> torch.device:
        return self.rows.device

    def set_roots(self, roots: Roots) -> None:
        tokens, lengths = roots.tokens, roots.lengths
        width = self.order - 1
        # checked at a decode's first roots (its prefill, which runs eagerly): later roots only
        # grow, and a compiled side (`side_graphs.py`) reads nothing
        if width and roots.origin is None and int(lengths.min()) < width:
            raise ValueError(f"every sequence needs at least {width} tokens for this table")
        offsets = lengths[:, None] - width + torch.arange(width, device=lengths.device)
        index = offsets[:, None, :].expand(-1, tokens.shape[1], -1)
        self._contexts = [tokens.gather(2, index)]  # [B, R, order-1]
        self._roots_pending = True

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        self.forward_calls += 1
        return self.scored(layers)

    def scored(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        """`forward` without its host counter: a function of tensors that reads nothing, so a
        side's graph can hold it (`side_graphs.GraphScorer`)."""
        roots = self._lookup(self._contexts[0]) if self._roots_pending else None
        self._roots_pending = False
        out = []
        for layer in layers:
            parents = self._contexts[-1]
            context = parents.gather(1, layer.parent[:, :, None].expand(-1, -1, parents.shape[2]))
            context = torch.cat([context[:, :, 1:], layer.token[:, :, None]], dim=2)
            context = context[:, :, context.shape[2] - (self.order - 1) :]
            self._contexts.append(context)
            out.append(self._lookup(context))
        return ForestLogprobs(roots=roots, layers=out)

    def release(self) -> None:
        self._contexts = []

    def _lookup(self, context: torch.Tensor) -> torch.Tensor:
        flat = torch.zeros(context.shape[:2], dtype=torch.long, device=context.device)
        for i in range(context.shape[2]):
            flat = flat * self._vocab + context[:, :, i]
        return self.rows[flat]
