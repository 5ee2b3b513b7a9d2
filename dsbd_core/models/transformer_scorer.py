"""A `ForestScorer` over a `transformers` causal LM: one forward per session scores a forest.

Layout (ALGORITHM.md §6): each session keeps its own KV cache whose batch rows are its alive
root beams (one row per tree). A forward feeds, per row, the root's uncached tokens (first call
after `set_roots` only) followed by the nodes of that tree from the given layers, right-padded
to the longest row. A 4-D additive attention mask lets

* a root token see the cached prefix and the root tokens before it (causal),
* a node see the whole prefix of its root, its ancestors' columns (fed in this or an earlier
  call of the iteration) and itself: nothing of siblings, cousins or padding,
* a padding slot see only itself (so its softmax stays finite; its output is never read).

Position ids are explicit: root token = its index in the sequence, node of layer `l` (1-based)
= `length - 1 + l`. Nodes of a layer share a position whatever their tree, exactly as if each
root-to-node path had been run alone.

transformers 5.23 passes a 4-D mask given by the caller through untouched (no causal mask is
added on top) for the `sdpa` and `eager` attention implementations, so the mask built here is
the whole truth; both implementations are supported, others are refused because they ignore or
re-shape arbitrary masks.

Caches are compacted at `set_roots` (ALGORITHM.md §6.4): new row `o` = old row `origin.root[o]`
restricted to the prefix columns plus the columns of the path nodes this scorer fed, gathered
along the sequence axis. The token id of every cache column is kept, so a compaction whose
kept tokens do not equal the new beam's leading tokens falls back to a re-prefill instead of
returning wrong distributions.

The forward layout (inputs, tree mask, output scatter) lives in `forest_plan`, the per-session
cache and its compaction in `kv_cache`, the packed forward of one or several sessions (each
attending alone over its own cache, `forest_attention`; linear rows batch-invariant,
`row_chunks`) in `packed_forward`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from dsbd_core.algorithm.draws.host_reads import one_copy
from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Origin, Roots
from dsbd_core.models.draft_variants import compact_logits, head_support, output_size
from dsbd_core.models.forest_plan import (
    ForestPlan,
    additive_mask,
    plan_forward,
    record_plan,
    scatter_outputs,
)
from dsbd_core.models.kv_cache import PAD_COLUMN, SessionCache, compact_cache
from dsbd_core.models.packed_forward import PackedPart, packed_forward, worth_packing
from dsbd_core.models.row_chunks import chunk_linear_rows

__all__ = ["PAD_COLUMN", "SUPPORTED_ATTENTION", "SessionCache", "TransformerScorer"]


SUPPORTED_ATTENTION = ("sdpa", "eager")


def session_roots(
    b: int, tokens: torch.Tensor, length: int, alive: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Session b's alive root rows and their tokens ([n, length]); None when no beam is alive.
    ValueError for a length outside the roots' capacity."""
    rows = alive.nonzero().squeeze(1)
    if rows.numel() == 0:
        return None
    if length < 1 or length > tokens.shape[2]:
        raise ValueError(f"session {b}: length {length} outside [1, {tokens.shape[2]}]")
    return rows, tokens[b, rows, :length]


def uncached_session(rows: torch.Tensor, root_tokens: torch.Tensor, cache: object) -> SessionCache:
    """A session with no cached column yet (a prefill follows) in `cache` (None: a new one)."""
    empty = torch.empty(rows.numel(), 0, dtype=torch.long, device=root_tokens.device)
    return SessionCache(rows, root_tokens, cache, empty, 0)


class TransformerScorer:
    """Scores forests with a transformers causal LM, keeping one KV cache per session.

    Build with `TransformerScorer(model)`; the model is put in eval mode. `forward_calls` counts
    the model forwards done (one per session with work per `forward` call). With
    `batch_invariant` (default) a session's outputs in a batched forward are bit-identical to
    its forward alone (`row_chunks`); off, large batches run their linear layers in fewer,
    larger calls and a session's last bits (and so a seeded decode) depend on its batch mates.
    """

    def __init__(
        self, model: PreTrainedModel, *, pack: bool = True, batch_invariant: bool = True
    ) -> None:
        attn = getattr(model.config, "_attn_implementation", None)
        if attn not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"TransformerScorer needs attn_implementation in {SUPPORTED_ATTENTION} "
                f"(a custom 4-D tree mask is honoured only there), got {attn!r}"
            )
        text_config = model.config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                "TransformerScorer supports full-attention models only (the tree mask would "
                f"ignore sliding windows and sliding caches drop columns), got {set(layer_types)}"
            )
        self.model = model.eval()
        chunk_linear_rows(model)  # batched: a row's bits must not depend on its batch mates
        self.forward_calls = 0
        self.pack = pack
        self.batch_invariant = batch_invariant
        self._sessions: list[SessionCache | None] = []
        self._out_device = torch.device("cpu")
        self._root_count = 0
        self._roots_pending = False

    # ------------------------------------------------------------------ ForestScorer API

    @property
    def vocab_size(self) -> int:
        """The logits' last dimension (the output embedding size, else config.vocab_size)."""
        return output_size(self.model)

    @property
    def engine_device(self) -> torch.device:
        """Where an in-process engine keeps its state (`loop.Decode`): beside the model, so
        that the log-probs a forward leaves there are used where they are."""
        return self.model.device

    def set_roots(self, roots: Roots) -> None:
        """Start an iteration: compact each session's cache to the new roots (or drop it)."""
        self._out_device = roots.tokens.device  # outputs go where the engine lives
        device = self._device
        if roots.host is not None and device.type == "cpu":
            roots = roots.host  # copied with the engine's planning values: no wait here
        tokens, lengths, alive, origin = roots.tokens, roots.lengths, roots.alive, roots.origin
        batch, root_count, _ = tokens.shape
        self._root_count = root_count
        self._roots_pending = True
        parts = [tokens, lengths, alive] + ([origin.root, origin.path] if origin else [])
        tokens, lengths, alive, *rest = one_copy(parts, device)
        lengths_list = [int(x) for x in lengths.tolist()]
        old = self._sessions if len(self._sessions) == batch else [None] * batch
        if origin is not None:
            origin = Origin(root=rest[0], path=rest[1])
        with torch.inference_mode():
            self._sessions = [
                self._start_session(b, tokens, lengths_list[b], alive[b], origin, old[b])
                for b in range(batch)
            ]

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        """One model forward per session over uncached root tokens and the given layers."""
        if not self._sessions:
            raise RuntimeError("forward called before set_roots")
        support, roots, outs = self._output_buffers(layers, self._result_device)
        with torch.inference_mode(), compact_logits(self.model):
            self._plan_and_run(layers, roots, outs)
        self._roots_pending = False
        to_out = self._out_device
        return ForestLogprobs(
            roots=roots.to(to_out) if roots is not None else None,
            layers=[x.to(to_out) for x in outs],
            support=support.to(to_out) if support is not None else None,
        )

    def _output_buffers(
        self, layers: Sequence[ForestLayer], device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor]]:
        """A call's answer to fill on `device`: the restricted head's tokens (None: the full
        vocabulary, which then sizes the rows), the roots' log-probs where they are due, and
        each layer's."""
        support = head_support(self.model)  # a restricted draft head answers K-wide
        vocab = self.vocab_size if support is None else support.numel()
        batch, dtype = len(self._sessions), self._out_dtype
        roots = None
        if self._roots_pending:
            roots = torch.zeros(batch, self._root_count, vocab, dtype=dtype, device=device)
        outs = [
            torch.zeros(batch, layer.token.shape[1], vocab, dtype=dtype, device=device)
            for layer in layers
        ]
        return support, roots, outs

    def release(self) -> None:
        """Drop every cache."""
        self._sessions = []
        self._roots_pending = False

    def export_sessions(self) -> list[SessionCache | None]:
        """Hand every session's cache to the caller, in batch order; the scorer keeps none.

        A serving replica keys them by request id between iterations and gives them back with
        `import_sessions` in whatever batch order its next forward has.
        """
        sessions, self._sessions = self._sessions, []
        self._roots_pending = False
        return sessions

    def import_sessions(self, sessions: list[SessionCache | None]) -> None:
        """Caches (batch order; None = nothing cached) that the next `set_roots` compacts from.

        `set_roots` checks every kept column's token id, so a stale or foreign cache costs a
        re-prefill, never a wrong distribution.
        """
        self._sessions = list(sessions)
        self._roots_pending = False

    # ------------------------------------------------------------------ introspection

    def session_cache(self, session: int) -> tuple[DynamicCache | None, torch.Tensor]:
        """The cache of a session and the token id of each of its columns (tests, debugging).

        Rows are the session's alive roots in increasing root index; `None` and an empty
        column list mean nothing is cached (a dead session, or a re-prefill is due).
        """
        s = self._sessions[session]
        if s is None:
            return None, torch.empty(0, 0, dtype=torch.long)
        return s.cache, s.column_tokens

    # ------------------------------------------------------------------ internals

    @property
    def _device(self) -> torch.device:
        return self.model.device

    @property
    def _result_device(self) -> torch.device:
        """Where a call's log-probs are assembled: where the forest is planned."""
        return self._device

    @property
    def _model_dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def _out_dtype(self) -> torch.dtype:
        return torch.float64 if self._model_dtype == torch.float64 else torch.float32

    def _start_session(
        self,
        b: int,
        tokens: torch.Tensor,
        length: int,
        alive: torch.Tensor,
        origin: Origin | None,
        old: SessionCache | None,
    ) -> SessionCache | None:
        """The session's state for a new iteration: compacted cache, or empty for a prefill."""
        roots = session_roots(b, tokens, length, alive)
        if roots is None:
            return None  # no alive beam: costs nothing, the old cache is released
        rows, root_tokens = roots
        if origin is not None and old is not None:
            compacted = compact_cache(old, root_tokens, origin.root[b, rows], origin.path[b, rows])
            if compacted is not None:
                cache, column_tokens = compacted
                return SessionCache(rows, root_tokens, cache, column_tokens, column_tokens.shape[1])
        return uncached_session(rows, root_tokens, None)

    def _plan_and_run(
        self, layers: Sequence[ForestLayer], roots: torch.Tensor | None, outs: list[torch.Tensor]
    ) -> None:
        """Lay out every session's forward where the forest is planned, then run them."""
        flat = one_copy([t for x in layers for t in (x.parent, x.token, x.exists)], self._device)
        layers = [ForestLayer(*flat[i : i + 3]) for i in range(0, len(flat), 3)]
        work = []
        for b, session in enumerate(self._sessions):
            if session is None:
                continue
            plan = plan_forward(b, session, layers, self._root_count)
            if plan.input_ids.shape[1] > 0:  # else: roots fed already and no existing node
                work.append((b, session, plan))
        if work:
            self._run_work(work, roots, outs)

    def _run_work(
        self,
        work: Sequence[tuple[int, SessionCache, ForestPlan]],
        roots: torch.Tensor | None,
        outs: list[torch.Tensor],
    ) -> None:
        """The model forwards of one `forward` call: one session alone, or several packed."""
        if len(work) == 1:
            self._forward_session(*work[0], roots, outs)
        else:
            self._forward_sessions(work, roots, outs)

    def _forward_session(
        self,
        b: int,
        session: SessionCache,
        plan: ForestPlan,
        roots: torch.Tensor | None,
        outs: list[torch.Tensor],
    ) -> None:
        """One session alone: run its forward on its own cache (no copies)."""
        cache = session.cache if session.cache is not None else DynamicCache()
        logprobs, cache = self._run(
            plan.input_ids, plan.position_ids, plan.allowed, plan.keep, _real(plan), cache
        )
        rank = plan.keep.flatten().cumsum(0).view_as(plan.keep) - 1  # row-major order of kept
        scatter_outputs(b, session, plan, logprobs, rank, roots, outs)
        record_plan(session, cache, plan)

    def _forward_sessions(
        self,
        work: Sequence[tuple[int, SessionCache, ForestPlan]],
        roots: torch.Tensor | None,
        outs: list[torch.Tensor],
    ) -> None:
        """Several sessions in ONE model forward (batching across requests).

        The sessions' real tokens run as one packed row through the linear layers, and each
        session attends alone over its own cache with the shapes of its own forward
        (`packed_forward`): no cache is copied into a shared layout, and every session gets the
        bits its forward alone gives, so a seeded request draws the same tokens whatever it is
        batched with (a layout widened to the batch mates' moves bfloat16's last bits).
        """
        self.forward_calls += 1
        parts = [self._part(session, plan) for _, session, plan in work]
        results = packed_forward(self.model, parts, invariant=self.batch_invariant)
        for (b, session, plan), (logits, cache) in zip(work, results, strict=True):
            logprobs = torch.log_softmax(logits, dim=-1, dtype=self._out_dtype)
            rank = plan.keep.flatten().cumsum(0).view_as(plan.keep) - 1
            scatter_outputs(b, session, plan, logprobs, rank, roots, outs)
            record_plan(session, cache, plan)

    def _part(self, session: SessionCache, plan: ForestPlan) -> PackedPart:
        """A session's forward as a part of a packed one: forest attention where its forward
        alone is packed, the model's own attention over the padded layout where it is not."""
        real = _real(plan)
        return PackedPart(
            plan.input_ids,
            plan.position_ids,
            plan.allowed,
            plan.keep,
            real,
            session.cache,
            dense=not (self.pack and worth_packing(real)),
        )

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        allowed: torch.Tensor,
        keep: torch.Tensor,
        real: torch.Tensor,
        cache: DynamicCache,
    ) -> tuple[torch.Tensor, DynamicCache]:
        """The model forward: log-probs at the kept positions (row-major) and the grown cache.

        An input that is mostly padding (uneven trees) runs packed into one row
        (`packed_forward`); the outputs and the cache layout are the padded forward's.
        """
        self.forward_calls += 1
        if self.pack and worth_packing(real):
            [(logits, cache)] = packed_forward(
                self.model, [PackedPart(input_ids, position_ids, allowed, keep, real, cache)]
            )
            return torch.log_softmax(logits, dim=-1, dtype=self._out_dtype), cache
        output = self.model(
            input_ids=input_ids,
            attention_mask=additive_mask(allowed, self._model_dtype),
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        logprobs = torch.log_softmax(output.logits, dim=-1, dtype=self._out_dtype)
        return logprobs, output.past_key_values


def _real(plan: ForestPlan) -> torch.Tensor:
    """[n, q] the slots that hold a token (root tokens and existing nodes), not padding."""
    real = plan.keep.clone()
    real[:, : plan.uncached] = True
    return real
