"""A draft that costs no forward: prompt lookup over each node's own context (issue 48).

Code and chat repeat names, phrases and whole lines of the prompt and of what was generated;
transformers (`prompt_lookup_num_tokens`, `max_matching_ngram_size`), vLLM (its `ngram`
speculator) and SGLang draft one sequence from it. Here it is a `ForestScorer` like any model,
so DSBD, SpS and speculative beam search verify its forests with the q it drew from and keep
their laws exactly.

The distribution at a node. The node's context c_1..c_T is the prompt, its beam and its forest
path. Its suffix of length n matches at position j < T when c_{j-n+1..j} = c_{T-n+1..T}. The
draft takes the longest n <= `ngram_max` with at least one match and returns the empirical
distribution of the tokens that followed those matches:

    q(v) = #{j : the n-suffix matches at j, c_{j+1} = v} / #{j : the n-suffix matches at j}

Where no n >= 1 matches (the node's last token never occurred before), every entry is -inf:
the node has no children (`draft_forest.draft_layer` then draws nothing from it), and a layer
whose parents all lack matches is empty, so verification fills it from the target's P: the
iteration emits what a beam-sampling step would (verify.fill_failed_layer, the chain being P).

Compact support (`ForestLogprobs.support`): only a token of some root's context can follow a
match (the forest's tokens are drawn from the same support), so the distributions are K wide,
K the distinct tokens of the batch's roots, fixed at `set_roots` for the whole iteration, as
a restricted draft head's are. K is padded with tokens of no mass to a power of two (at least
`min_support`, at most V), so that an engine compiled per shape (`side_graphs.py`) meets a
handful of widths, not one per iteration. The tables are float64: exact ratios of counts.

A look-up, not a forward: per node it compares the last `ngram_max` tokens with every
position of its context (O(T x ngram_max) element-wise, vectorised over all nodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Roots
from dsbd_core.algorithm.scorers.ngram_bounds import NGRAM_DEFAULT, check_ngram_max


class NgramDraft:
    """The prompt-lookup draft (module doc): next-token distributions from suffix matches.

    `vocab_size`: the target's (the draft must name the same token ids); `ngram_max`: the
    longest suffix matched (1..NGRAM_MAX).
    """

    def __init__(
        self, vocab_size: int, ngram_max: int = NGRAM_DEFAULT, *, min_support: int = 256
    ) -> None:
        self._vocab = int(vocab_size)
        self.ngram_max = check_ngram_max(ngram_max)
        self.min_support = max(1, min_support)
        self.forward_calls = 0
        self._contexts: list[torch.Tensor] = []  # per layer (0: roots) [B, M, T_l]
        self._lengths = torch.zeros(0, dtype=torch.long)  # [B] root lengths
        self._support = torch.zeros(0, dtype=torch.long)
        self._roots_pending = False

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def set_roots(self, roots: Roots) -> None:
        tokens, lengths, alive = roots.tokens, roots.lengths, roots.alive
        positions = torch.arange(tokens.shape[2], device=tokens.device)
        inside = (positions[None, None, :] < lengths[:, None, None]) & alive[:, :, None]
        self._support = self._padded(torch.unique(tokens[inside]))  # sorted
        self._lengths = lengths
        self._contexts = [tokens]
        self._roots_pending = True

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        self.forward_calls += 1
        roots = None
        if self._roots_pending:
            roots = self._lookup(self._contexts[0], self._lengths)
            self._roots_pending = False
        out = []
        for layer in layers:
            parents = self._contexts[-1]
            depth = len(self._contexts)  # tokens the layer's path adds to the roots
            index = layer.parent[:, :, None].expand(-1, -1, parents.shape[2])
            context = torch.cat(
                [parents.gather(1, index), parents.new_zeros(*index.shape[:2], 1)], 2
            )
            at = (self._lengths + depth - 1)[:, None, None].expand(-1, index.shape[1], 1)
            context.scatter_(2, at, layer.token[:, :, None])
            self._contexts.append(context)
            out.append(self._lookup(context, self._lengths + depth))
        return ForestLogprobs(roots=roots, layers=out, support=self._support)

    def release(self) -> None:
        self._contexts = []

    def _padded(self, support: torch.Tensor) -> torch.Tensor:
        """`support` (sorted, distinct) with the smallest ids outside it added, up to a power
        of two >= `min_support` (V at most): tokens of no mass, whose columns change no draw."""
        size = max(self.min_support, 1 << max(support.numel() - 1, 0).bit_length())
        size = min(max(size, support.numel(), 1), max(self._vocab, support.numel(), 1))
        if support.numel() >= size:
            return support
        outside = torch.ones(max(self._vocab, 1), dtype=torch.bool, device=support.device)
        outside[support[support < outside.numel()]] = False
        extra = outside.nonzero()[: size - support.numel(), 0]
        return torch.cat([support, extra]).sort().values

    # a SessionBatcher keeps per-session caches of its scorer: this one has none
    def export_sessions(self) -> list[Any]:
        rows = self._contexts[0].shape[0] if self._contexts else 0
        return [None] * rows

    def import_sessions(self, sessions: list[Any]) -> None:
        """Nothing to put back: every call carries the tokens the look-up needs."""

    def _lookup(self, context: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Log q over the support [B, M, K] for contexts [B, M, T], session b's `lengths[b]`
        long (right-padded)."""
        batch, rows, width = context.shape
        device = context.device
        j = torch.arange(width, device=device)
        length = lengths[:, None, None]  # [B, 1, 1]
        # match[n - 1][b, m, j]: the n-suffix occurs ending at j (followed by c_{j+1})
        run = (j[None, None, :] < length - 1).expand(batch, rows, width)
        best = torch.zeros(batch, rows, width, dtype=torch.bool, device=device)
        for k in range(self.ngram_max):
            end = (length - 1 - k).clamp_min(0).expand(batch, rows, 1)
            last = context.gather(2, end)  # c_{T-k}
            shifted = torch.roll(context, k, dims=2)  # shifted[j] = c_{j-k}
            run = run & (shifted == last) & (j >= k) & (length - 1 - k >= 0)
            here = run.any(dim=2, keepdim=True)
            best = torch.where(here, run, best)  # the longest n with a match so far
        follower = torch.roll(context, -1, dims=2)  # c_{j+1}
        column = torch.searchsorted(self._support, follower.reshape(-1)).clamp_(
            max=self._support.numel() - 1
        )
        counts = torch.zeros(
            batch * rows, self._support.numel(), dtype=torch.float64, device=device
        )
        counts.scatter_add_(
            1, column.view(batch * rows, width), best.view(batch * rows, -1).double()
        )
        counts = counts.view(batch, rows, -1)
        total = counts.sum(dim=2, keepdim=True)
        return (counts / total.clamp_min(1.0)).log()  # no match: all -inf, no children
