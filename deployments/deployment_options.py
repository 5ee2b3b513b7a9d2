"""One deployment's Serve options, one route for each: `Resources`.

A Serve deployment option reaches Serve by exactly one of two routes. dsbd has typed fields only
for the options it gives a meaning of its own: the CPUs, GPUs and custom resources of a replica
(checked against the models' devices, and bundle 0 of a tensor-parallel verifier's placement
group) and the replica count (dsbd's autoscaling policy, and the share of the session memory
each ingress replica admits). Every other Serve option goes through `serve_options`, checked by
Serve's own schema, over dsbd's own values for it (`SERVE_DEFAULTS`: how many requests a replica
takes at once, the health checks). An option a typed field owns is refused in `serve_options`,
naming the field, and so is a Serve option given where a typed field would be. A Serve config
file's `deployments:` section is Serve's own override, applied by Serve over all of this.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deployments.autoscaling import POLICY_PATH as AUTOSCALING_POLICY
from deployments.replicas.allocator import Allocator, replica_runtime_env
from deployments.replicas.model_options import ModelOptions, worker_bundle
from dsbd_core.algorithm.config import first_error

# Resources Ray schedules by name that `Resources` sets through its own fields.
BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# dsbd's values for Serve options it has no field for, under every deployment's `serve_options`:
# the health checks (a lost tensor-parallel rank fails its replica's), and per kind how many
# requests a replica takes at once (the decode loops' replicas many, the model replicas a batch).
HEALTH_CHECKS = {"health_check_period_s": 10.0, "health_check_timeout_s": 30.0}
SERVE_DEFAULTS: dict[str, dict[str, Any]] = {
    "ingress": {**HEALTH_CHECKS, "max_ongoing_requests": 256},
    "router": {**HEALTH_CHECKS, "max_ongoing_requests": 256},
    "pair": {**HEALTH_CHECKS, "max_ongoing_requests": 256},
    "draft": {**HEALTH_CHECKS, "max_ongoing_requests": 64},
    "verifier": {**HEALTH_CHECKS, "max_ongoing_requests": 64},
}
# Serve options a typed field owns: (where in Serve's options, the field to use instead).
OWNED = {
    ("num_replicas",): "min_replicas = max_replicas",
    ("autoscaling_config", "min_replicas"): "min_replicas",
    ("autoscaling_config", "max_replicas"): "max_replicas",
    ("autoscaling_config", "target_ongoing_requests"): "target_ongoing_requests",
    ("ray_actor_options", "num_cpus"): "num_cpus",
    ("ray_actor_options", "num_gpus"): "num_gpus",
    ("ray_actor_options", "resources"): "resources",
}


class Resources(BaseModel):
    """Replicas and resources of one deployment (module docstring: which route an option takes)."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="Autoscaling target per replica."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, e.g. {dsbd_draft: 1} to keep a deployment "
        "on the nodes (KubeRay worker group) that advertise that resource.",
    )
    serve_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Every other Ray Serve deployment option, passed to Serve over dsbd's own "
        "values (max_ongoing_requests, health_check_period_s, health_check_timeout_s) and "
        "checked by Serve's own schema (ray.serve.schema.DeploymentSchema), e.g. "
        "{max_ongoing_requests: 128, graceful_shutdown_timeout_s: 60, autoscaling_config: "
        "{upscale_delay_s: 5}}. A mapping merges into the one dsbd sets (autoscaling_config, "
        "ray_actor_options). What a field above owns is refused here, naming the field.",
    )

    @model_validator(mode="before")
    @classmethod
    def _serve_options_by_their_route(cls, value: Any) -> Any:
        """A Serve option dsbd has no field for, given as a field, names its route."""
        if isinstance(value, dict):
            for name in value:
                if name not in cls.model_fields and name in _serve_option_names():
                    raise ValueError(
                        f"{name}: a Ray Serve option dsbd has no field for; give it as "
                        f"serve_options.{name}"
                    )
        return value

    @model_validator(mode="after")
    def _replicas_in_order(self) -> Resources:
        """Named here, not by Serve's DeploymentConfig when the application is built."""
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} > max_replicas={self.max_replicas}; "
                "allowed: min_replicas <= max_replicas"
            )
        return self

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in BUILTIN_RESOURCES:
                raise ValueError(f"resources.{name}: use num_cpus/num_gpus; {name} is built in")
            if amount <= 0:
                raise ValueError(f"resources.{name}={amount}: must be > 0")
        return value

    @field_validator("serve_options")
    @classmethod
    def _serve_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Serve's own schema decides what a deployment option may be; a field owns its own."""
        from ray.serve.schema import DeploymentSchema

        allowed = sorted(_serve_option_names())
        for name in value:
            if name not in allowed:
                raise ValueError(
                    f"serve_options.{name}: not a Ray Serve deployment option (the name is "
                    f"dsbd's); allowed: {', '.join(allowed)}"
                )
        for path, field in OWNED.items():
            if _get(value, path) is not None:
                raise ValueError(
                    f"serve_options.{'.'.join(path)}: set by dsbd's field {field}; give it there"
                )
        try:
            DeploymentSchema.model_validate({"name": "check", **value})
        except ValidationError as error:
            message = first_error(error, "serve_options")
            raise ValueError(f"{message} (Ray Serve's deployment schema)") from None
        return value

    def options(
        self,
        model: ModelOptions | None = None,
        inherited_env: dict[str, Any] | None = None,
        allocator: Allocator | None = None,
        kind: str = "verifier",
    ) -> dict[str, Any]:
        """Serve deployment options: dsbd's values for a deployment of `kind` (SERVE_DEFAULTS),
        the typed fields and `serve_options` over them. A model with `tp_size > 1` adds its
        placement group: the replica's own bundle first, then one bundle per rank
        (deployments/replicas/tp_group.py). A deployment without a model gets `allocator`
        (None: the environment's malloc)."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus}
        if model is not None:
            allocator, primitive_cache = model.allocator, model.primitive_cache
        else:
            primitive_cache = None  # no matmuls outside the model replicas
        if allocator:  # the replicas' memory (deployments/replicas/allocator.py)
            actor["runtime_env"] = replica_runtime_env(allocator, primitive_cache, inherited_env)
        if self.num_gpus:
            actor["num_gpus"] = self.num_gpus
        if self.resources:
            actor["resources"] = dict(self.resources)
        placement: dict[str, Any] = {}
        if model is not None and model.tp_size > 1:
            # A bundle may not be empty; the replica's own resources must fit in bundle 0.
            own = {"CPU": self.num_cpus or 0.01, **self.resources}
            rank = worker_bundle(model.threads, model.device)
            placement = {
                "placement_group_bundles": [own] + [rank] * model.tp_size,
                "placement_group_strategy": model.tp_placement,
            }
        scaling: dict[str, Any]
        if (
            self.min_replicas == self.max_replicas
            and "autoscaling_config" not in self.serve_options
        ):
            scaling = {"num_replicas": self.max_replicas}
        else:
            scaling = {
                "autoscaling_config": {
                    "min_replicas": self.min_replicas,
                    "max_replicas": self.max_replicas,
                    "target_ongoing_requests": self.target_ongoing_requests,
                    "policy": {"policy_function": AUTOSCALING_POLICY},  # no flapping
                }
            }
        options = {**SERVE_DEFAULTS[kind], "ray_actor_options": actor, **placement, **scaling}
        return with_serve_options(options, self.serve_options)


def with_serve_options(options: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`options` with a deployment's pass-through Serve options over them: a mapping merges
    into dsbd's, any other value replaces it."""
    merged = dict(options)
    for name, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = {**merged[name], **value}
        else:
            merged[name] = value
    return merged


def resources_from_serve_options(options: dict[str, Any]) -> dict[str, Any]:
    """`Resources` fields from Serve deployment options as Ray Serve LLM's `deployment_config`
    gives them (all of Serve's options in one mapping): what a typed field owns moves to it
    (num_replicas to min and max replicas), the rest stays in `serve_options`."""
    rest = {k: dict(v) if isinstance(v, dict) else v for k, v in options.items()}
    fields: dict[str, Any] = {}
    if "num_replicas" in rest:
        count = rest.pop("num_replicas")
        fields.update(min_replicas=count, max_replicas=count)
    for path, field in OWNED.items():
        if len(path) == 2 and isinstance(rest.get(path[0]), dict) and path[1] in rest[path[0]]:
            fields[field] = rest[path[0]].pop(path[1])
            if not rest[path[0]]:
                del rest[path[0]]
    return {**fields, "serve_options": rest}


def _serve_option_names() -> set[str]:
    from ray.serve.schema import DeploymentSchema

    return set(DeploymentSchema.model_fields) - {"name"}


def _get(options: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = options
    for part in path:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value
