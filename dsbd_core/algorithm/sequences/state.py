"""What a decode carries between its steps: the state, the forest, the verified outcome.

These are plain data so that they can cross processes: the serving router keeps a `DecodeState`
per request, the forest goes from the draft's holder to the target's, the `Outcome` comes back.
Every tensor is batched over `B` sessions (a session: one prompt's beams, i.e. one row of the
batch), each with up to `W` beams.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from dsbd_core.algorithm.scorer import ForestLayer, Origin, Roots
from dsbd_core.algorithm.sequences.logprobs import IterationLogprobs, TokenLogprobs

# Per-session integer counters. "proposed": draft tokens in the forest (every node drafted);
# "drafted": those of them verification reached (a live parent in a verified layer).
COUNTERS = ("target", "draft", "proposed", "drafted", "accepted")


def zero_counters(batch: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every counter at zero for `batch` sessions (the float `epsilon_bias` sum included)."""
    counters = {name: torch.zeros(batch, dtype=torch.long, device=device) for name in COUNTERS}
    counters["epsilon_bias"] = torch.zeros(batch, dtype=torch.float64, device=device)
    return counters


@dataclass
class Pool:
    """Beams that left decoding (finished at EOS, or alive when the budget ran out)."""

    session: list[torch.Tensor] = field(default_factory=list)
    tokens: list[torch.Tensor] = field(default_factory=list)  # generated tokens, padded
    length: list[torch.Tensor] = field(default_factory=list)
    score: list[torch.Tensor] = field(default_factory=list)
    finished: list[torch.Tensor] = field(default_factory=list)
    # config.logprobs set: each entry's token log-probs ([n, T]), kept by the router (the
    # verifier's pool entries get theirs in `Engine.advance`, from `Outcome.logprobs`)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # per entry: which of its rows are pool beams. All of them where the engine found the
    # leaving beams by reading a mask (the host); on a device the engine pools every row of
    # the mask with the mask here instead of waiting for the read (`beams.pool_add`)
    kept: list[torch.Tensor] = field(default_factory=list)

    def extend(self, other: Pool) -> None:
        """Append another pool's beams (an iteration's finished beams to the session's pool)."""
        self.session += other.session
        self.tokens += other.tokens
        self.length += other.length
        self.score += other.score
        self.finished += other.finished
        self.logprobs += other.logprobs
        self.kept += other.kept


@dataclass
class DecodeState:
    """What a batch of sessions carries between iterations: token ids, scores, flags, counters.

    Small by design: it is what the serving router keeps per request; the models' KV caches live
    with the scorers, the forest only between `propose` and `verify`.
    """

    tokens: torch.Tensor  # [B, W, L] prompt + generated tokens of every input beam
    length: torch.Tensor  # [B]
    prompt_len: torch.Tensor  # [B]
    score: torch.Tensor  # [B, W] true log-likelihood of the generated tokens
    alive: torch.Tensor  # [B, W]
    remaining: torch.Tensor  # [B] width left (W minus finished beams)
    steps: torch.Tensor  # [B] tokens emitted so far
    origin: Origin | None
    pool: Pool
    counters: dict[str, torch.Tensor]
    seed: int = 0  # base of every random stream (config.seed, or drawn once at start)
    iteration: int = 0  # iterations advanced so far
    history: list[dict[str, torch.Tensor]] = field(default_factory=list)
    live: torch.Tensor | None = None  # [B] sessions decoding in the current iteration
    depth: torch.Tensor | None = None  # [B] layers drafted in the current iteration
    # (depth, its maximum): read once when the iteration is planned (`deepest_layer`)
    planned: tuple[torch.Tensor, int] | None = None
    # config.logprobs set: the token log-probs of every beam's generated positions [B, W, T]
    # (router side only: the verifier sends what an iteration adds, `logprobs.Segment`)
    logprobs: TokenLogprobs | None = None
    # the iteration's roots on the host, copied with the planning values where the state lives
    # on a device (`Roots.host`); None on the host
    host_roots: Roots | None = None
    # deterministic beam search (config.search): the length-normalised scores of the best W
    # finished hypotheses so far, best first, -inf where fewer have finished [B, W]
    finished_scores: torch.Tensor | None = None
    # the next iteration's plan where the last verify side's graph made it (`Engine.verify`)
    plan: Plan | None = None

    def for_models(self) -> DecodeState:
        """What the draft and the verifier need of the state: no pool, history, counters or
        log-probs.

        This is the message a serving router sends each iteration (a few KiB): the beams'
        tokens, scores and flags, the planned depth, and the `Origin` the caches compact from.
        """
        return replace(self, pool=Pool(), counters={}, history=[], logprobs=None, plan=None)


def roots_of(state: DecodeState) -> Roots:
    """The beams the iteration starts from, with their host copy where there is one."""
    return Roots(state.tokens, state.length, state.alive, state.origin, host=state.host_roots)


def deepest_layer(state: DecodeState) -> int:
    """The most layers any session drafts this iteration: the planned value where `depth` is
    the tensor it was planned with, else read from `depth` (a state rebuilt elsewhere)."""
    assert state.depth is not None, "plan the iteration first (Engine.next_iteration)"
    if state.planned is not None and state.planned[0] is state.depth:
        return state.planned[1]
    return int(state.depth.max()) if state.depth.numel() else 0


@dataclass
class Forest:
    """The draft's proposal for one iteration (ALGORITHM.md §3): travels from draft to verifier."""

    layers: list[ForestLayer]
    tables: list[torch.Tensor]  # per layer: the draft table Q_l [B, parents x V] (or x K)
    probs: list[torch.Tensor]  # per layer: exact draw probability of every draft [B, W_S]
    # None, or [K] long: the tables are over these tokens only (a restricted draft head), the
    # draft's probability of every other token is 0.
    support: torch.Tensor | None = None

    def full_table(self, level: int, vocab: int) -> torch.Tensor:
        """Layer `level`'s (1-based) draft table over every (parent, token): [B, parents x V]."""
        table = self.tables[level - 1]
        if self.support is None:
            return table
        batch, k = table.shape[0], self.support.numel()
        full = table.new_zeros(batch, table.shape[1] // k, vocab)
        full.index_copy_(2, self.support, table.view(batch, -1, k))
        return full.view(batch, -1)


NO_FOREST = Forest([], [], [])  # what an iteration without drafted layers verifies


@dataclass
class Outcome:
    """What verification of one iteration returns: the next input beams and what to count.

    Computed on the verifier's side (it holds the forest), so the caller never needs the forest.
    """

    tokens: torch.Tensor
    length: torch.Tensor
    score: torch.Tensor
    alive: torch.Tensor
    remaining: torch.Tensor
    origin: Origin
    emitted: torch.Tensor  # [B] tokens each session's beams grew by
    finished: Pool  # beams that left decoding this iteration
    record: dict[str, torch.Tensor]  # accepted_layers, widths, alphas (per session)
    counters: dict[str, torch.Tensor]  # increments: COUNTERS, epsilon_bias
    logprobs: IterationLogprobs | None = None  # config.logprobs set: what the beams added
    finished_scores: torch.Tensor | None = None  # beam search: DecodeState.finished_scores
    plan: Plan | None = None  # the next iteration's plan, made inside a fused verify graph


@dataclass
class Plan:
    """An iteration's plan (`plan_iteration`): which sessions decode, which beams retire (their
    budget spent), each session's depth, the flags the host reads (any retired, any live,
    the deepest depth) and the roots' rows once the retired left. Made for one `gamma`."""

    gamma: int
    live: torch.Tensor  # [B] bool
    retired: torch.Tensor  # [B, W] bool
    depth: torch.Tensor  # [B] long
    flags: torch.Tensor  # [3] long
    roots_alive: torch.Tensor  # [B, W] bool
    # `planning_parts` packed into one float64 buffer (`host_reads.packed`) where a verify
    # graph made the plan: the host's planning read is then one copy of it
    record: torch.Tensor | None = None


def plan_iteration(
    length: torch.Tensor,
    prompt_len: torch.Tensor,
    remaining: torch.Tensor,
    alive: torch.Tensor,
    max_new_tokens: int,
    gamma: int,
) -> Plan:
    """The plan of an iteration starting from these beams (a function of tensors: the fused
    verify side computes the next one inside its graph, `side_graphs.verify_side`;
    `max_new_tokens` bounds every session's budget, `gamma` its depth)."""
    budget = max_new_tokens - (length - prompt_len)
    live = (remaining > 0) & (budget > 0) & alive.any(dim=1)
    retired = alive & ~live[:, None]  # budget spent: the beams leave unfinished
    # never overshoot the budget: an iteration emits at most depth + 1 tokens
    depth = torch.where(live, (budget - 1).clamp(max=gamma), torch.zeros_like(budget))
    # the iteration's one read of planning values (a wait, where the state is on a GPU)
    flags = torch.stack([retired.any().long(), live.any().long(), depth.max()])
    return Plan(gamma, live, retired, depth, flags, alive & live[:, None])


def planning_parts(
    tokens: torch.Tensor, length: torch.Tensor, origin: Origin | None, plan: Plan
) -> list[torch.Tensor]:
    """What the host reads when it plans an iteration on a device: the plan's flags and the
    roots (tokens, lengths, rows, origin) the scorers plan their forwards from."""
    parts = [plan.flags, tokens, length, plan.roots_alive]
    return parts + ([origin.root, origin.path] if origin is not None else [])
