"""The replicas' autoscaling rule (deployments/autoscaling.py) holds its count under a steady
load where Serve's default rule flaps, and still scales as fast when the load moves.

Both rules run inside Serve's own wrapper (`_apply_autoscaling_config`: scaling factors and the
up/down delays, here 0 s so every decision acts at once) on real `AutoscalingContext`s; the
load readings are those the controller logged in the eleventh soak (32 clients, routers'
target 16): 32.75 before an upscale, 31.83 before a downscale.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from ray.serve.autoscaling_policy import _apply_autoscaling_config, default_autoscaling_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.app import AppArgs
from deployments.autoscaling import DOWNSCALE_UTILIZATION, steady_queue_length_policy

TARGET = 16.0


def config(**overrides: Any) -> AutoscalingConfig:
    return AutoscalingConfig(
        **{
            "min_replicas": 1,
            "max_replicas": 4,
            "target_ongoing_requests": TARGET,
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            **overrides,
        }
    )


def context(replicas: int, ongoing: float, state: dict[str, Any]) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="Router",
        app_name="dsbd",
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        running_replicas=[],
        total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics={},
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=config(),
    )


def replica_counts(rule: Callable[..., Any], start: int, readings: list[float]) -> list[int]:
    """The replica count after each control-loop step of `rule` under Serve's wrapper, each
    decision taking effect at once (the count clipped to min/max_replicas, as the controller)."""
    wrapped = _apply_autoscaling_config(rule)
    replicas, state, counts = start, {}, []
    for ongoing in readings:
        decision, state = wrapped(context(replicas, ongoing, dict(state)))
        replicas = max(1, min(4, decision))
        counts.append(replicas)
    return counts


def changes(counts: list[int]) -> int:
    return sum(a != b for a, b in itertools.pairwise(counts))


def test_a_steady_load_at_a_multiple_of_the_target_flaps_under_serves_rule_not_under_ours():
    readings = [32.0, 32.75, 31.83, 32.0, 32.75, 31.83, 31.5, 32.4] * 5
    serve = replica_counts(default_autoscaling_policy, 2, readings)
    ours = replica_counts(steady_queue_length_policy, 2, readings)
    assert changes(serve) >= 10, serve  # up at 32.75, down at 31.83, again and again
    assert set(serve) == {2, 3}
    assert changes(ours) == 1, ours  # up once at the first 32.75, then held
    assert ours[-1] == 3


@pytest.mark.parametrize("ongoing", [0.0, 5.0, 20.0, 33.0, 47.0, 64.0, 80.0])
def test_upscaling_is_as_fast_as_serves(ongoing: float):
    for start in (1, 2):
        serve = replica_counts(default_autoscaling_policy, start, [ongoing])
        ours = replica_counts(steady_queue_length_policy, start, [ongoing])
        if serve[0] > start:
            assert ours == serve


def test_downscaling_goes_to_the_count_that_runs_at_most_four_fifths_of_the_target():
    for ongoing in (0.0, 5.0, 12.0, 12.9, 20.0, 25.0, 25.7, 31.0, 38.0, 38.5, 47.0):
        (after,) = replica_counts(steady_queue_length_policy, 4, [ongoing])
        expected = max(1, -(-ongoing // (TARGET * DOWNSCALE_UTILIZATION)))  # ceil, >= min
        assert after == expected, (ongoing, after)
        assert ongoing <= after * TARGET * DOWNSCALE_UTILIZATION or after == 4


def test_the_app_configures_the_rule_for_every_autoscaled_deployment_and_serve_loads_it():
    args = AppArgs()
    options = args.router_resources.options()
    loaded = AutoscalingConfig(**options["autoscaling_config"])
    rule = loaded.policy.get_policy()  # Serve's copy (it pickles the function for the controller)
    assert (rule.__module__, rule.__name__) == (
        "deployments.autoscaling",
        "steady_queue_length_policy",
    )
    assert replica_counts(rule, 2, [32.75, 31.83]) == [3, 3]
    assert "autoscaling_config" in args.ingress_resources.options()
    fixed = args.router_resources.model_copy(update={"min_replicas": 2, "max_replicas": 2})
    assert "autoscaling_config" not in fixed.options()  # a fixed count has no rule
