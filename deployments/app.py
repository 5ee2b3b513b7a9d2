"""The application: ingress, router, draft, verifier and width controller, from one pydantic
config.

`build_app(args)` is the Ray Serve application builder that `serve_config.yaml` names
(`import_path: deployments.app:build_app`); `dsbd serve` deploys the same config. Every
deployment gets its own resources, replicas and Serve options from `AppArgs` (`Resources`,
deployments/deployment_options.py: one route per Serve option, typed fields only where dsbd
gives an option a meaning of its own, every other one through `serve_options` over dsbd's
values), and a `deployments:` section of a Serve config file can still override them by name
(Ingress, Router, Draft, Verifier, SessionRegistry), as with any Serve application.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.api.limits import Limits, RouterOptions
from deployments.definitions import DRAFT, INGRESS, PAIR, ROUTER, SESSION_REGISTRY, VERIFIER
from deployments.deployment_options import Resources
from deployments.replicas.affinity import ROUTER_CLASS
from deployments.replicas.allocator import Allocator
from deployments.replicas.model_options import ModelOptions
from dsbd_core.algorithm.config import first_error
from dsbd_core.algorithm.policy.cost_model import CostPolicy
from dsbd_core.algorithm.scorers.ngram_bounds import LOOKUP_DRAFT


class AppArgs(BaseModel):
    """Everything `build_app` needs; the defaults serve the embedded SmolLM2 pair."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = "smollm2"
    target: ModelOptions = ModelOptions(source="smollm2")
    draft: ModelOptions = ModelOptions(source="smollm2-draft")
    default_max_tokens: int = Field(64, ge=1, le=32768)
    session_affinity: bool = Field(True, description="Route a session's calls to its cache.")
    limits: Limits = Limits()
    api_key_file: str | None = Field(
        None, description="File holding the API key (else DSBD_API_KEY; neither: no key)."
    )
    cost_policy: CostPolicy = Field(
        CostPolicy(), description="Priors of the cost model that chooses each iteration's depth."
    )
    ingress_resources: Resources = Resources(
        num_cpus=0.05, max_replicas=2, target_ongoing_requests=64
    )  # parses, checks, admits and streams; the decode loops run in the routers
    router_resources: Resources = Resources(num_cpus=0.1, max_replicas=4)
    allocator: Allocator = Field(
        "jemalloc",
        description="The ingress and router replicas' malloc: jemalloc (Ray's, "
        "preloaded; their RSS flat under load) or system (glibc's: the ingress's climbed ~25 "
        "MiB over 8 minutes and dropped at once, again and again). The model replicas have "
        "their own: target.allocator, draft.allocator. deployments/replicas/allocator.py.",
    )
    draft_resources: Resources = Resources(num_cpus=0.5)
    verifier_resources: Resources = Resources(num_cpus=1.0)
    request_defaults: dict[str, Any] = Field(
        default_factory=dict,
        description="Request fields a request gets when it does not set them, by the HTTP "
        "API's names (method, width, gamma, threshold, adaptive, draft_width, ...), e.g. "
        "{method: beam, width: 4}; checked as a request would be.",
    )
    layout: Literal["auto", "split", "colocated"] = Field(
        "auto",
        description="split: a Router, a Draft and a Verifier deployment, two Serve calls per "
        "iteration (the draft and the verifier scale, fail and sit on GPUs apart; a "
        "tensor-parallel verifier); colocated: one Pair deployment whose replicas own both "
        "models and run the decode loops, an iteration two calls inside one process "
        "(deployments/decode/pair.py; its replicas take verifier_resources, router_resources "
        "and draft_resources are unused); auto: colocated when the target runs on cuda "
        "without tensor parallelism, else split.",
    )

    @model_validator(mode="after")
    def _default_within_limits(self) -> AppArgs:
        if self.default_max_tokens > self.limits.max_new_tokens:
            raise ValueError(
                f"default_max_tokens={self.default_max_tokens} exceeds limits.max_new_tokens="
                f"{self.limits.max_new_tokens}"
            )
        return self

    @field_validator("request_defaults")
    @classmethod
    def _defaults_are_request_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Each default is a decoding field of the HTTP API, with a value a request may give."""
        from deployments.api.models import DecodingKnobs, GenerateRequest

        allowed = sorted(DecodingKnobs.model_fields)
        for name in value:
            if name not in allowed:
                raise ValueError(
                    f"request_defaults.{name}: not a request field dsbd takes a default for; "
                    f"allowed: {', '.join(allowed)}"
                )
        try:
            GenerateRequest.model_validate({"prompt_ids": [0], **value})
        except ValidationError as error:
            raise ValueError(first_error(error, "request_defaults")) from None
        return value

    @model_validator(mode="after")
    def _lookup_drafts_only(self) -> AppArgs:
        """'ngram' names the prompt-lookup draft: it has no weights to verify with."""
        if self.target.source == LOOKUP_DRAFT:
            raise ValueError(
                f"target.source={LOOKUP_DRAFT!r}: the prompt-lookup draft cannot be the target; "
                "allowed: a preset, a transformers directory, a .gguf file or a hub id"
            )
        return self

    @property
    def colocated(self) -> bool:
        """Whether one Pair deployment serves (the `layout` field, `auto` resolved)."""
        if self.layout == "auto":
            return self.target.device == "cuda" and self.target.tp_size == 1
        return self.layout == "colocated"

    @model_validator(mode="after")
    def _devices_match_resources(self) -> AppArgs:
        """A model's device and TP size must agree with its deployment's GPUs (co-located:
        the Pair's, which are verifier_resources)."""
        draft_where = "verifier_resources" if self.colocated else "draft_resources"
        for model, resources, side, where in (
            (self.target, self.verifier_resources, "target", "verifier_resources"),
            (self.draft, getattr(self, draft_where), "draft", draft_where),
        ):
            if model.tp_size > 1 and resources.num_gpus > 0:
                raise ValueError(
                    f"{where}.num_gpus={resources.num_gpus} with {side}.tp_size="
                    f"{model.tp_size}: must be 0 (the replica only coordinates; each TP rank "
                    f"gets one GPU of its own when {side}.device is cuda)"
                )
            if model.tp_size == 1 and model.device == "cuda" and resources.num_gpus <= 0:
                raise ValueError(
                    f"{side}.device='cuda' needs {where}.num_gpus > 0 (got "
                    f"{resources.num_gpus}), or {side}.tp_size > 1"
                )
        return self


def _application_runtime_env() -> dict[str, Any]:
    """The runtime_env of the application being built (Serve runs the builder under it)."""
    import ray

    if not ray.is_initialized():
        return {}
    return dict(ray.get_runtime_context().runtime_env or {})


def model_deployments(
    config: AppArgs, inherited: dict[str, Any], suffix: str = ""
) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """One model's deployments, bound: router (or co-located pair), draft, verifier, width
    controller, and the ingress's options for it (`Ingress`'s `ModelHandles`). `suffix` tells
    apart the deployments of several models in one application (Serve names are unique)."""
    routing: dict[str, Any] = {}
    if config.session_affinity:
        routing["request_router_config"] = RequestRouterConfig(request_router_class=ROUTER_CLASS)  # type: ignore[arg-type]  # mypy misreads Ray's str | Callable field
    controller_name = f"SessionRegistry{suffix}"
    policy, ttl = config.cost_policy.model_dump(), config.target.session_ttl_s
    router_options = RouterOptions(
        model_name=config.model_name,
        tokenizer=config.target.source,
        default_max_tokens=config.default_max_tokens,
        limits=config.limits,
        api_key_file=config.api_key_file,
        router_replicas=config.ingress_resources.max_replicas,  # memory admission's share
        request_defaults=config.request_defaults,
        colocated=config.colocated,
    ).model_dump()
    if config.colocated:  # the pair's caches die with its loops: nothing to release from outside
        controller = SESSION_REGISTRY.options(name=controller_name).bind(policy, ttl)
        pair = PAIR.options(
            name=f"Pair{suffix}",
            **config.verifier_resources.options(config.target, inherited, kind="pair"),
        ).bind(config.target.model_dump(), config.draft.model_dump(), controller)
        return pair, pair, pair, controller, router_options
    draft = DRAFT.options(
        name=f"Draft{suffix}",
        **config.draft_resources.options(config.draft, inherited, kind="draft"),
        **routing,
    ).bind(config.draft.model_dump(), config.target.source)  # the look-up: the target's vocab
    verifier = VERIFIER.options(
        name=f"Verifier{suffix}",
        **config.verifier_resources.options(config.target, inherited),
        **routing,
    ).bind(config.target.model_dump())
    # the controller frees a dead router's sessions on the draft and the verifier
    controller = SESSION_REGISTRY.options(name=controller_name).bind(policy, ttl, draft, verifier)
    serving: dict[str, Any] = {"inherited_env": inherited, "allocator": config.allocator}  # loops
    router = ROUTER.options(
        name=f"Router{suffix}", **config.router_resources.options(**serving, kind="router")
    ).bind(draft, verifier, controller)
    return router, draft, verifier, controller, router_options


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    """The Serve application for `args` (a dict as given in a Serve config file)."""
    config = AppArgs.model_validate(args or {})
    inherited = _application_runtime_env()
    serving: dict[str, Any] = {"inherited_env": inherited, "allocator": config.allocator}  # HTTP
    ingress = INGRESS.options(**config.ingress_resources.options(**serving, kind="ingress"))
    return ingress.bind([model_deployments(config, inherited)])
