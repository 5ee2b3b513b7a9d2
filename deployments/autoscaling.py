"""The replicas' autoscaling rule: Serve's queue-length rule with a band between scaling up and
scaling down, so that a steady load does not start and stop a replica again and again.

Why: Serve's default rule (`replica_queue_length_autoscaling_policy`) wants ceil(ongoing /
target) replicas both ways, so a steady load near a multiple of the target flaps: a replica
starts when the ongoing requests read just above the multiple, stops after Serve's downscale
delay when they read just below, and starts again (seen in a soak:
docs/history/RELIABILITY-chronicle.md section 10). Each start costs a process (hundreds of MiB
for a router) and its warm-up, and leaves the new worker's metric series in Ray's node metrics
agent for the agent's life (dsbd/bench/smaps_census.py). Flapping is churn for
the user and a slow leak for the node.

The rule: up as Serve's (ceil(ongoing / target), so a burst is met as fast as before); down only
to the count that would run at `DOWNSCALE_UTILIZATION` of the target or less, ceil(ongoing /
(0.8 target)). Between the two the count stays. Serve's wrapper still applies the delays, the
scaling factors and min/max_replicas to what this returns.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

# The most a replica may be asked to run, as a fraction of its target, right after a downscale.
DOWNSCALE_UTILIZATION = 0.8

POLICY_PATH = f"{__name__}:steady_queue_length_policy"


def steady_queue_length_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Desired replicas for Serve's `AutoscalingContext` `ctx` (see the module docstring)."""
    current = ctx.current_num_replicas
    if current == 0:  # as Serve's rule: no replica running, keep the target it set
        return ctx.target_num_replicas, {}
    assert ctx.config is not None  # Serve passes the deployment's autoscaling config
    target = ctx.config.get_target_ongoing_requests()
    ongoing = ctx.total_num_requests
    wanted = ongoing / target
    if wanted > current:
        return wanted, {}
    return float(min(current, math.ceil(ongoing / (target * DOWNSCALE_UTILIZATION)))), {}
