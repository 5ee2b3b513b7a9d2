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


INGRESS = _by_path("deployments.api.ingress.Ingress", name="Ingress", max_ongoing_requests=256)
ROUTER = _by_path("deployments.decode.router.Router", name="Router", max_ongoing_requests=256)
PAIR = _by_path("deployments.decode.pair.Pair", name="Pair", max_ongoing_requests=256)
DRAFT = _by_path("deployments.replicas.draft.Draft", name="Draft", max_ongoing_requests=64)
VERIFIER = _by_path(
    "deployments.replicas.verifier.Verifier", name="Verifier", max_ongoing_requests=64
)
# One replica: a small dict of sessions and a few arithmetic operations per call.
SESSION_REGISTRY = _by_path(
    "deployments.decode.session_registry.SessionRegistry",
    name="SessionRegistry",
    max_ongoing_requests=1000,
    ray_actor_options={"num_cpus": 0},
)
