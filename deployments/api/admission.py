"""Admission by memory: what a decode's KV caches cost a replica, and the budget they share.

What exhausts a model replica is not the number of sessions but their KV bytes: W beams x the
columns each beam's cache can reach x layers x 2 (keys and values) x KV heads x head dim x the
dtype's bytes, on the target and on the draft. A beam's cache reaches the prompt, the new
tokens and, during a forest forward, the nodes of its tree: at most gamma layers x W_S drafts
each. A batched forward holds more than the caches themselves: the stored caches, each
session's grown cache (its columns and the new ones, concatenated: dsbd_core/models/
packed_forward.py) and, while the draft grows its forest layer by layer, the cache before and
after a layer; so a session is charged `WORKING_COPIES` times its KV bytes. Three copies were
charged until a test run measured the draft 302 MiB above its idle level with two decodes of
76.5 MiB of cache admitted: 3.95 copies, when batched forwards still copied every session's
cache into a stacked one as well; they no longer do, so the charge is an upper bound now
(tests/serving/test_faults.py checks the replicas' peak memory stays under the budget;
tests/serving/test_admission.py the arithmetic).

Each replica reports its model's `kv_bytes_per_token` (per beam and cache column, per device:
a tensor-parallel rank holds 1/tp of the KV heads) and its budget, `session_memory_bytes`
(configured in `ModelOptions`, else a fraction of the device's free memory when the replica
starts). The ingress charges each decode before any model work: a decode that could never fit
is refused with HTTP 400 naming the request's field and the limit, and one that does not fit
beside the decodes already admitted gets HTTP 429. Every ingress replica admits against its
share of the budget (the budget / the ingress's `max_replicas`), so the ingresses together never
admit more than one replica can hold, wherever Serve sends the sessions.

Not covered: a forward's activations (the attention scores of a long prompt's prefill, heads x
prompt^2 x dtype bytes per layer, freed layer by layer) come on top of the budget; the default
fraction leaves room for them.
"""

from __future__ import annotations

from typing import Any

from deployments.api.errors import APIError
from dsbd_core.algorithm.methods import MethodConfig

SIDES = ("target", "draft")


def router_view(target: dict[str, Any], draft: dict[str, Any], routers: int) -> dict[str, Any]:
    """The figures one ingress replica admits against: each side's per-token bytes and its share
    of the side's budget (`routers`: the ingress deployment's max_replicas; the name is from
    when the router was the ingress)."""
    view: dict[str, Any] = {"routers": routers}
    for side, info in (("target", target), ("draft", draft)):
        memory = info.get("memory")
        if memory is not None:
            view[side] = {**memory, "share_bytes": memory["session_memory_bytes"] // routers}
    return view


def session_charge(
    config: MethodConfig, prompt_len: int, view: dict[str, Any] | None
) -> dict[str, int]:
    """Bytes one decode is charged on each side (module docstring); {} without figures."""
    if not view:
        return {}
    gamma = config.draft_depth
    columns = prompt_len + config.max_new_tokens + gamma * config.effective_draft_width
    charge = {}
    for side in SIDES if config.uses_draft else ("target",):
        if side in view:
            figures = view[side]
            per_column = figures["kv_bytes_per_token"] * figures["working_copies"]
            charge[side] = config.width * columns * per_column
    return charge


def check_fits(
    config: MethodConfig,
    prompt_len: int,
    view: dict[str, Any] | None,
    tokens_field: str,
) -> None:
    """HTTP 400 for a decode that could never be admitted: its charge exceeds this ingress's
    share of a side's budget even with nothing else running."""
    for side, charge in session_charge(config, prompt_len, view).items():
        figures = view[side]  # type: ignore[index]  # a charge is there only with a view
        if charge > figures["share_bytes"]:
            gamma = config.draft_depth
            raise APIError(
                400,
                f"width={config.width} x (prompt of {prompt_len} tokens + {tokens_field}="
                f"{config.max_new_tokens} + gamma x draft_width = {gamma} x "
                f"{config.effective_draft_width}) needs {_mib(charge)} of the {side}'s session "
                f"memory (KV cache x {figures['working_copies']} working copies); this server "
                f"admits at most {_mib(figures['share_bytes'])} per decode ({side}."
                f"session_memory_bytes={figures['session_memory_bytes']} / {view['routers']} "  # type: ignore[index]  # a charge is there only with a view
                f"ingress replica(s)); allowed: a shorter prompt, a smaller {tokens_field} or "
                "width",
                tokens_field,
            )


class MemoryLedger:
    """The bytes of the decodes one ingress replica admitted, per side (its admissions), and the
    most it has held at once: a poller sampling `admitted` can miss a moment two decodes
    overlap, the high-water mark cannot."""

    def __init__(self) -> None:
        self.admitted = {side: 0 for side in SIDES}
        self.peak = {side: 0 for side in SIDES}

    def take(self, charge: dict[str, int], view: dict[str, Any] | None) -> None:
        """Count a decode in, or HTTP 429 when it does not fit beside the others."""
        for side, amount in charge.items():
            share = view[side]["share_bytes"]  # type: ignore[index]  # a charge is there only with a view
            if self.admitted[side] + amount > share:
                raise APIError(
                    429,
                    f"this server's {side} session memory is taken ({_mib(self.admitted[side])}"
                    f" of {_mib(share)} admitted, this decode needs {_mib(amount)}: "
                    f"{side}.session_memory_bytes); retry shortly",
                    None,
                )
        for side, amount in charge.items():
            self.admitted[side] += amount
            self.peak[side] = max(self.peak[side], self.admitted[side])

    def give_back(self, charge: dict[str, int]) -> None:
        for side, amount in charge.items():
            self.admitted[side] -= amount


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"
