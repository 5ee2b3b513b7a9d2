"""The application's deployments as Serve sees them: each one's name, its Serve options and the
import path of its class, which only its replicas import.

Why by path: a Serve deployment made from a class makes every process that builds the
application import the class's module, and the replicas' modules import torch, transformers and
the engine (`import deployments.app`: 8.4 CPU-s with the classes bound, 1.9 without, means of 3
interleaved runs on the 2-core AMD EPYC). That process is `dsbd serve` checking its config,
Serve's build task of each application and Ray's `serve run`; each runs before any replica can
start (a one-application server of the tiny pair: 34-42 s to ready against 44-54 s, 3
interleaved rounds; benchmarks/results/suite_time_epyc.json, "deployments_by_path"). Serve loads
a path in the replica (`ray.serve._private.replica`), so a replica runs the class it names as it
would a bound one; the options here are the deployments' defaults, which `app.py` overrides per
application (`.options`).
"""

from __future__ import annotations

from typing import Any, cast

from ray import serve
from ray.serve import Deployment


def _by_path(path: str, **options: Any) -> Deployment:
    """The deployment of the class at `path` with Serve `options` (Ray types the decorator's
    argument as a callable; its `ReplicaConfig.create` takes an import path as well)."""
    return serve.deployment(**options)(cast(Any, path))


# The replicas behind the ingress, once told to stop, check for calls still running after 0.2 s
# and every 0.2 s after that (Serve's default: 2 s). Their callers are dsbd's own deployments,
# which Serve stops first (tier by tier, callers before callees) and which retry a call a stopped
# replica did not answer (docs/RELIABILITY.md), so the wait protects no call. With Serve's
# default each of the four tiers took ~2.5 s: a one-application server stopped in 13.5-14.5 s,
# with 0.2 s in 8.9-9.4 s (3 interleaved rounds on the 2-core AMD EPYC;
# benchmarks/results/suite_time_epyc.json, "drain_loop").
_DRAINS: dict[str, Any] = {"graceful_shutdown_wait_loop_s": 0.2}

INGRESS = _by_path("deployments.api.ingress.Ingress", name="Ingress", max_ongoing_requests=256)
ROUTER = _by_path(
    "deployments.decode.router.Router", name="Router", max_ongoing_requests=256, **_DRAINS
)
PAIR = _by_path("deployments.decode.pair.Pair", name="Pair", max_ongoing_requests=256, **_DRAINS)
DRAFT = _by_path(
    "deployments.replicas.draft.Draft", name="Draft", max_ongoing_requests=64, **_DRAINS
)
VERIFIER = _by_path(
    "deployments.replicas.verifier.Verifier", name="Verifier", max_ongoing_requests=64, **_DRAINS
)
# One replica: a small dict of sessions and a few arithmetic operations per call.
SESSION_REGISTRY = _by_path(
    "deployments.decode.session_registry.SessionRegistry",
    name="SessionRegistry",
    max_ongoing_requests=1000,
    ray_actor_options={"num_cpus": 0},
    **_DRAINS,
)
