"""A `ForestScorer` over a `transformers` causal LM: one forward per session scores a forest.

Layout (spec §6): every session keeps its own KV cache whose batch rows are the session's alive
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

Caches are compacted at `set_roots` (spec §6.4): new row `o` = old row `origin.root[o]`
restricted to the prefix columns plus the columns of the path nodes this scorer fed, gathered
along the sequence axis. The token id of every cache column is kept, so a compaction whose
kept tokens do not equal the new beam's leading tokens falls back to a re-prefill instead of
returning wrong distributions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from dsbd_core.algorithm.scorer import ForestLayer, ForestLogprobs, Origin, Roots

SUPPORTED_ATTENTION = ("sdpa", "eager")
PAD_COLUMN = -1  # token id recorded for a padding column of the cache (never a real token)


@dataclass
class _LayerPlacement:
    """Where the nodes of one fed forest layer of one session sit in the cache.

    row:       [M] long — local cache row (tree) of each node, -1 for a padding node.
    column:    [M] long — cache column of each node, -1 for a padding node.
    ancestors: [M, l] long — cache columns of the node's ancestors at layers 1..l, itself last;
               a node's mask row over the node part is exactly these columns.
    """

    row: torch.Tensor
    column: torch.Tensor
    ancestors: torch.Tensor


@dataclass
class _Session:
    """The KV cache of one session and what each of its columns holds.

    rows:          [n] long — root index (in `R`) of each cache row, i.e. the alive roots.
    tokens:        [n, length] long — the roots' full token sequences.
    cache:         the model's cache, batch rows = `rows`; None when nothing is cached yet.
    column_tokens: [n, C] long — token id of every cache column (PAD_COLUMN for padding slots).
    prefix_cols:   number of leading columns that are root tokens (the root prefix cached).
    layers:        placements of the forest layers fed since `set_roots`.
    """

    rows: torch.Tensor
    tokens: torch.Tensor
    cache: DynamicCache | None
    column_tokens: torch.Tensor
    prefix_cols: int
    layers: list[_LayerPlacement] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def cached_cols(self) -> int:
        return self.column_tokens.shape[1]

    @property
    def roots_fed(self) -> bool:
        return self.prefix_cols == self.length


SessionCache = _Session  # public name: what export_sessions / import_sessions carry


@dataclass
class _Plan:
    """The padded model input of one session forward and where to read its outputs."""

    input_ids: torch.Tensor  # [n, q]
    position_ids: torch.Tensor  # [n, q]
    allowed: torch.Tensor  # [n, q, C + q] bool
    keep: torch.Tensor  # [n, q] bool: positions whose logits are needed
    uncached: int  # root tokens fed in this forward (0 if the roots were already fed)
    placements: list[_LayerPlacement]
    node_index: list[torch.Tensor]  # per layer: indices of the existing nodes


class TransformerScorer:
    """Scores forests with a transformers causal LM, keeping one KV cache per session.

    Build with `TransformerScorer(model)`; the model is put in eval mode. `forward_calls` counts
    the model forwards done (one per session with work per `forward` call).
    """

    def __init__(self, model: PreTrainedModel) -> None:
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
        self.forward_calls = 0
        self._sessions: list[_Session | None] = []
        self._out_device = torch.device("cpu")
        self._root_count = 0
        self._roots_pending = False

    # ------------------------------------------------------------------ ForestScorer API

    @property
    def vocab_size(self) -> int:
        """The logits' last dimension (the output embedding size, else config.vocab_size)."""
        head = self.model.get_output_embeddings()
        if head is not None and getattr(head, "weight", None) is not None:
            return int(head.weight.shape[0])
        return int(self.model.config.get_text_config(decoder=True).vocab_size)

    def set_roots(self, roots: Roots) -> None:
        """Start an iteration: compact each session's cache to the new roots (or drop it)."""
        tokens, lengths, alive, origin = roots.tokens, roots.lengths, roots.alive, roots.origin
        batch, root_count, _ = tokens.shape
        self._out_device = tokens.device
        self._root_count = root_count
        self._roots_pending = True
        device = self._device
        tokens = tokens.to(device)
        alive = alive.to(device)
        lengths_list = [int(x) for x in lengths.tolist()]
        old = self._sessions if len(self._sessions) == batch else [None] * batch
        if origin is not None:
            origin = Origin(root=origin.root.to(device), path=origin.path.to(device))
        with torch.inference_mode():
            self._sessions = [
                self._start_session(b, tokens, lengths_list[b], alive[b], origin, old[b])
                for b in range(batch)
            ]

    def forward(self, layers: Sequence[ForestLayer]) -> ForestLogprobs:
        """One model forward per session over uncached root tokens and the given layers."""
        if not self._sessions:
            raise RuntimeError("forward called before set_roots")
        batch = len(self._sessions)
        vocab = self.vocab_size
        dtype = self._out_dtype
        device = self._device
        want_roots = self._roots_pending
        roots = (
            torch.zeros(batch, self._root_count, vocab, dtype=dtype, device=device)
            if want_roots
            else None
        )
        outs = [
            torch.zeros(batch, layer.token.shape[1], vocab, dtype=dtype, device=device)
            for layer in layers
        ]
        layers = [
            ForestLayer(
                parent=x.parent.to(device), token=x.token.to(device), exists=x.exists.to(device)
            )
            for x in layers
        ]
        with torch.inference_mode():
            work = []
            for b, session in enumerate(self._sessions):
                if session is None:
                    continue
                plan = _plan_forward(b, session, layers, self._root_count)
                if plan.input_ids.shape[1] > 0:  # else: roots fed already and no existing node
                    work.append((b, session, plan))
            if len(work) == 1:
                self._forward_session(*work[0], roots, outs)
            elif work:
                self._forward_sessions(work, roots, outs)
        self._roots_pending = False
        to_out = self._out_device
        return ForestLogprobs(
            roots=roots.to(to_out) if roots is not None else None,
            layers=[x.to(to_out) for x in outs],
        )

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
        old: _Session | None,
    ) -> _Session | None:
        """The session's state for a new iteration: compacted cache, or empty for a prefill."""
        rows = alive.nonzero().squeeze(1)
        if rows.numel() == 0:
            return None  # no alive beam: costs nothing, the old cache is released
        if length < 1 or length > tokens.shape[2]:
            raise ValueError(f"session {b}: length {length} outside [1, {tokens.shape[2]}]")
        root_tokens = tokens[b, rows, :length]
        if origin is not None and old is not None:
            compacted = _compact(old, root_tokens, origin.root[b, rows], origin.path[b, rows])
            if compacted is not None:
                cache, column_tokens = compacted
                return _Session(rows, root_tokens, cache, column_tokens, column_tokens.shape[1])
        empty = torch.empty(rows.numel(), 0, dtype=torch.long, device=tokens.device)
        return _Session(rows, root_tokens, None, empty, 0)

    def _forward_session(
        self,
        b: int,
        session: _Session,
        plan: _Plan,
        roots: torch.Tensor | None,
        outs: list[torch.Tensor],
    ) -> None:
        """One session alone: run its forward on its own cache (no copies)."""
        cache = session.cache if session.cache is not None else DynamicCache()
        logprobs, cache = self._run(plan.input_ids, plan.position_ids, plan.allowed, plan.keep,
                                    cache)  # fmt: skip
        rank = plan.keep.flatten().cumsum(0).view_as(plan.keep) - 1  # row-major order of kept
        _scatter_outputs(b, session, plan, logprobs, rank, roots, outs)
        _record(session, cache, plan)

    def _forward_sessions(
        self,
        work: list[tuple[int, _Session, _Plan]],
        roots: torch.Tensor | None,
        outs: list[torch.Tensor],
    ) -> None:
        """Several sessions in ONE model forward (batching across requests).

        Each session's rows keep their own cache columns, left-aligned in a shared cache of the
        longest session's width; the columns a shorter session does not have are masked out.
        New tokens go after that shared width and are split back per session afterwards, so
        every session ends with exactly the cache a forward of its own would have produced.
        Positions are explicit, so where a column sits does not change its rotary encoding.
        """
        device = self._device
        width = max(s.cached_cols for _, s, _ in work)
        q_len = max(p.input_ids.shape[1] for _, _, p in work)
        rows = sum(s.rows.numel() for _, s, _ in work)
        input_ids = torch.zeros(rows, q_len, dtype=torch.long, device=device)
        position_ids = torch.zeros(rows, q_len, dtype=torch.long, device=device)
        keep = torch.zeros(rows, q_len, dtype=torch.bool, device=device)
        allowed = _padding_allowed(rows, q_len, width, device)
        starts = []
        start = 0
        for _, session, plan in work:
            n, q, c = session.rows.numel(), plan.input_ids.shape[1], session.cached_cols
            block = slice(start, start + n)
            input_ids[block, :q] = plan.input_ids
            position_ids[block, :q] = plan.position_ids
            keep[block, :q] = plan.keep
            allowed[block, :q, :c] = plan.allowed[:, :, :c]
            allowed[block, :q, width : width + q] = plan.allowed[:, :, c:]
            starts.append(start)
            start += n
        cache = _stack_caches([(s, st) for (_, s, _), st in zip(work, starts, strict=True)],
                              rows, width)  # fmt: skip
        logprobs, cache = self._run(input_ids, position_ids, allowed, keep, cache)
        rank = keep.flatten().cumsum(0).view_as(keep) - 1
        for (b, session, plan), first in zip(work, starts, strict=True):
            n, q, c = session.rows.numel(), plan.input_ids.shape[1], session.cached_cols
            block = slice(first, first + n)
            _scatter_outputs(b, session, plan, logprobs, rank[block], roots, outs)
            own = [
                (
                    torch.cat(
                        [layer.keys[block, :, :c], layer.keys[block, :, width : width + q]], 2
                    ),
                    torch.cat(
                        [layer.values[block, :, :c], layer.values[block, :, width : width + q]], 2
                    ),
                )
                for layer in cache.layers
            ]
            _record(session, DynamicCache(ddp_cache_data=own), plan)

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        allowed: torch.Tensor,
        keep: torch.Tensor,
        cache: DynamicCache,
    ) -> tuple[torch.Tensor, DynamicCache]:
        """The model forward: log-probs at the kept positions (row-major) and the grown cache."""
        output = self.model(
            input_ids=input_ids,
            attention_mask=_additive_mask(allowed, self._model_dtype),
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        self.forward_calls += 1
        return output.logits.to(self._out_dtype).log_softmax(-1), output.past_key_values


def _scatter_outputs(
    b: int,
    session: _Session,
    plan: _Plan,
    logprobs: torch.Tensor,
    rank: torch.Tensor,
    roots: torch.Tensor | None,
    outs: list[torch.Tensor],
) -> None:
    """Write one session's root and node log-probs; `rank` maps its (row, query) to kept rows."""
    if plan.uncached > 0 and roots is not None:
        roots[b, session.rows] = logprobs[rank[:, plan.uncached - 1]]
    for out, placement, index in zip(outs, plan.placements, plan.node_index, strict=True):
        if index.numel() > 0:
            row = placement.row[index]
            query = placement.column[index] - session.cached_cols
            out[b, index] = logprobs[rank[row, query]]


def _stack_caches(sessions: list[tuple[_Session, int]], rows: int, width: int) -> DynamicCache:
    """One cache for several sessions: session rows at their offsets, columns left-aligned."""
    template = next((s.cache for s, _ in sessions if s.cache is not None), None)
    if template is None or width == 0:
        return DynamicCache()
    data = []
    for index, layer in enumerate(template.layers):
        heads, dim = layer.keys.shape[1], layer.keys.shape[3]
        keys = layer.keys.new_zeros(rows, heads, width, dim)
        values = layer.values.new_zeros(rows, heads, width, dim)
        for session, start in sessions:
            if session.cache is None or session.cached_cols == 0:
                continue
            own = session.cache.layers[index]
            block = slice(start, start + session.rows.numel())
            keys[block, :, : session.cached_cols] = own.keys
            values[block, :, : session.cached_cols] = own.values
        data.append((keys, values))
    return DynamicCache(ddp_cache_data=data)


def _plan_forward(
    b: int, session: _Session, layers: Sequence[ForestLayer], root_count: int
) -> _Plan:
    """Lay out one session's forward: root tail then each tree's nodes, per row (spec §6.1)."""
    device = session.tokens.device
    n = session.rows.numel()
    c_old = session.cached_cols
    uncached = session.length - session.prefix_cols
    if uncached > 0 and c_old != session.prefix_cols:
        raise AssertionError("nodes cached before the roots were fed")
    local_of_root = torch.full((root_count,), -1, dtype=torch.long, device=device)
    local_of_root[session.rows] = torch.arange(n, device=device)
    fill = torch.zeros(n, dtype=torch.long, device=device)  # nodes placed per row so far
    previous = session.layers[-1] if session.layers else None
    placements: list[_LayerPlacement] = []
    node_index: list[torch.Tensor] = []
    for offset, layer in enumerate(layers):
        depth = len(session.layers) + offset + 1
        placement, index = _place_layer(
            b, layer, depth, previous, local_of_root, fill, uncached + c_old
        )
        placements.append(placement)
        node_index.append(index)
        previous = placement
    q_len = uncached + int(fill.max()) if n > 0 else 0
    input_ids = torch.zeros(n, q_len, dtype=torch.long, device=device)
    position_ids = torch.zeros(n, q_len, dtype=torch.long, device=device)
    keep = torch.zeros(n, q_len, dtype=torch.bool, device=device)
    allowed = _padding_allowed(n, q_len, c_old, device)
    if uncached > 0:
        input_ids[:, :uncached] = session.tokens[:, session.prefix_cols :]
        position_ids[:, :uncached] = torch.arange(
            session.prefix_cols, session.length, device=device
        )
        columns = torch.arange(c_old + q_len, device=device)
        queries = torch.arange(uncached, device=device)
        allowed[:, :uncached] = columns[None, :] <= (c_old + queries)[:, None]  # causal
        keep[:, uncached - 1] = True
    for depth_offset, (layer, placement, index) in enumerate(
        zip(layers, placements, node_index, strict=True)
    ):
        depth = len(session.layers) + depth_offset + 1
        row = placement.row[index]
        query = placement.column[index] - c_old
        input_ids[row, query] = layer.token[b, index]
        position_ids[row, query] = session.length - 1 + depth
        allowed[row, query, : session.length] = True  # the whole root prefix
        allowed[row[:, None], query[:, None], placement.ancestors[index]] = True
        keep[row, query] = True
    return _Plan(input_ids, position_ids, allowed, keep, uncached, placements, node_index)


def _place_layer(
    b: int,
    layer: ForestLayer,
    depth: int,
    previous: _LayerPlacement | None,
    local_of_root: torch.Tensor,
    fill: torch.Tensor,
    first_node_column: int,
) -> tuple[_LayerPlacement, torch.Tensor]:
    """Give every existing node of a layer its tree row and cache column; updates `fill`.

    Nodes of one tree are placed in node order after the nodes already placed in that row in
    this forward, so ancestors always precede descendants (their columns are smaller).
    """
    device = fill.device
    m = layer.token.shape[1]
    index = layer.exists[b].nonzero().squeeze(1)
    parent = layer.parent[b, index]
    if depth == 1:
        row = local_of_root[parent]
        parent_ancestors = torch.empty(index.numel(), 0, dtype=torch.long, device=device)
    else:
        if previous is None:
            raise ValueError(f"layer {depth} given before layer {depth - 1} was fed")
        row = previous.row[parent]
        parent_ancestors = previous.ancestors[parent]
    if bool((row < 0).any()):
        raise ValueError(f"session {b}, layer {depth}: a node's parent is dead or padding")
    one_hot = torch.nn.functional.one_hot(row, fill.numel())  # [k, n]
    rank = (one_hot.cumsum(0) - one_hot).gather(1, row[:, None]).squeeze(1)
    column = first_node_column + fill[row] + rank
    fill += one_hot.sum(0)
    placement = _LayerPlacement(
        row=torch.full((m,), -1, dtype=torch.long, device=device),
        column=torch.full((m,), -1, dtype=torch.long, device=device),
        ancestors=torch.full((m, depth), -1, dtype=torch.long, device=device),
    )
    placement.row[index] = row
    placement.column[index] = column
    placement.ancestors[index] = torch.cat([parent_ancestors, column[:, None]], dim=1)
    return placement, index


def _padding_allowed(n: int, q_len: int, c_old: int, device: torch.device) -> torch.Tensor:
    """Start every query row as padding: it sees only its own column (finite softmax)."""
    allowed = torch.zeros(n, q_len, c_old + q_len, dtype=torch.bool, device=device)
    queries = torch.arange(q_len, device=device)
    allowed[:, queries, c_old + queries] = True
    return allowed


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, q, kv] bool -> [n, 1, q, kv] additive mask (0 allowed, dtype-min disallowed)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def _record(session: _Session, cache: DynamicCache, plan: _Plan) -> None:
    """Remember what the forward appended to the cache (token ids, placements, root prefix)."""
    fed = plan.input_ids.clone()
    real = plan.keep.clone()
    real[:, : plan.uncached] = True  # root tokens are real even where no logits were kept
    fed[~real] = PAD_COLUMN
    session.cache = cache
    session.column_tokens = torch.cat([session.column_tokens, fed], dim=1)
    session.prefix_cols = session.length
    session.layers.extend(plan.placements)


def _compact(
    old: _Session, tokens: torch.Tensor, old_root: torch.Tensor, path: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor] | None:
    """Gather the old cache down to the new roots' accepted paths (spec §6.4).

    tokens: [n, length] the new roots; old_root: [n] old root index; path: [n, D] node per layer.
    Returns the new cache and column tokens, or None when a re-prefill is needed (unknown old
    root, nothing kept, or kept token ids differing from the new beams').
    """
    device = tokens.device
    local_of_root = torch.full(
        (max(int(old.rows.max()), int(old_root.max())) + 1,), -1, dtype=torch.long, device=device
    )
    local_of_root[old.rows] = torch.arange(old.rows.numel(), device=device)
    if bool((old_root < 0).any()):
        return None
    old_row = local_of_root[old_root]
    if bool((old_row < 0).any()) or old.cache is None:
        return None
    path_columns = _path_columns(old, old_row, path)
    columns = torch.cat(
        [torch.arange(old.prefix_cols, device=device).expand(old_row.numel(), -1), path_columns],
        dim=1,
    )[:, : tokens.shape[1] - 1]  # the last token of a beam is always fed again
    kept = columns.shape[1]
    if kept == 0:
        return None
    column_tokens = old.column_tokens[old_row].gather(1, columns)
    if not torch.equal(column_tokens, tokens[:, :kept]):
        return None
    data = []
    for layer in old.cache.layers:
        data.append(
            (
                _gather_columns(layer.keys, old_row, columns),
                _gather_columns(layer.values, old_row, columns),
            )
        )
    return DynamicCache(ddp_cache_data=data), column_tokens


def _path_columns(old: _Session, old_row: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """[n, K] cache columns of the path nodes every new root keeps (same K for all rows).

    A row keeps its path while each node was fed, lies in the row's tree and descends from the
    previously kept node (its ancestor columns equal the kept ones); all rows are cut to the
    shortest kept path because a session's cache rows share one length.
    """
    n = old_row.numel()
    columns = torch.empty(n, 0, dtype=torch.long, device=old_row.device)
    going = torch.ones(n, dtype=torch.bool, device=old_row.device)
    for depth in range(min(path.shape[1], len(old.layers))):
        placement = old.layers[depth]
        node = path[:, depth]
        safe = node.clamp(0, placement.row.numel() - 1)
        column = placement.column[safe]
        ancestors = placement.ancestors[safe]
        going &= (node >= 0) & (node < placement.row.numel())
        going &= (placement.row[safe] == old_row) & (column >= 0)
        going &= (ancestors[:, :depth] == columns).all(dim=1)
        if not bool(going.all()):
            break
        columns = torch.cat([columns, column[:, None]], dim=1)
    return columns


def _gather_columns(
    states: torch.Tensor, old_row: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """[rows, heads, C, dim] -> [n, heads, K, dim]: row old_row[i], columns columns[i]."""
    selected = states.index_select(0, old_row)
    heads, dim = selected.shape[1], selected.shape[3]
    index = columns[:, None, :, None].expand(-1, heads, -1, dim)
    return selected.gather(2, index)
