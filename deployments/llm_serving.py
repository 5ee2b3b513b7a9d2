"""Ray Serve LLM's config shape: `llm_configs`, several models behind one OpenAI ingress.

Why: people who serve LLMs on Ray write an `LLMServingArgs` (a list of `LLMConfig`s) and deploy
it with `ray.serve.llm:build_openai_app`, in Python or as `import_path` + `args` of a Serve
config (which KubeRay's `serveConfigV2` carries unchanged). `build_openai_app` here takes that
shape, without `ray[llm]` or vLLM, so such a file serves DSBD by changing its `import_path`
to `deployments.llm_serving:build_openai_app`:

    model_loading_config.model_id       the name clients send (`model`), listed at /v1/models
    model_loading_config.model_source   the target: a preset, a directory of any transformers
                                        causal LM, a .gguf file or a hub id (default: model_id)
    engine_kwargs.speculative_config    the draft: `model` (a preset, a directory, ... or
                                        `ngram`; vLLM's `method: ngram` too, with
                                        `prompt_lookup_max` its longest suffix),
                                        `num_speculative_tokens` the requests' default and
                                        largest draft depth (gamma)
    engine_kwargs.tensor_parallel_size  the verifier's tensor-parallel degree
    engine_kwargs.dtype                 auto, bfloat16, float32 or float64
    engine_kwargs.<request field>       dsbd's knobs by the HTTP API's names (method, width,
                                        gamma, threshold, selection, adaptive: the cost model
                                        on or off, ...): that model's request defaults
    engine_kwargs.<dsbd field>          layout, device, threads, decode_path, limits,
                                        default_max_tokens, cost_policy (`AppArgs`'s)
    deployment_config                   Serve options of the model's draft and verifier (or
                                        pair) deployments, autoscaling_config included
    accelerator_type                    the replicas' `accelerator_type` (Ray schedules them on
                                        that GPU model), both models on cuda, one GPU each
    placement_group_config.strategy     the tensor-parallel group's placement strategy
    ingress_deployment_config           the ingress's Serve options

Everything else Ray Serve LLM or vLLM accepts is an error that names the field and says
"not supported by dsbd" (a vLLM engine option such as `max_model_len`, LoRA, a server class, a
per-model `runtime_env`: give that on the application), or, misspelled, what is allowed: a file
is never served with a part of it silently ignored. Each model gets its own router, draft,
verifier and session registry (its deployments' names end in `:<model_id>`), admission, metrics
labels and traces; one ingress routes by `model` (deployments/api/ingress.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from ray.serve import Application

from deployments.api.models import DecodingKnobs
from deployments.app import AppArgs, _application_runtime_env, model_deployments
from deployments.definitions import INGRESS
from deployments.deployment_options import OWNED, Resources, resources_from_serve_options
from dsbd_core.algorithm.config import error_words
from dsbd_core.algorithm.scorers.ngram_bounds import LOOKUP_DRAFT

NOT_SUPPORTED = "not supported by dsbd"
# AppArgs' names of what an LLMConfig names otherwise (its errors are given in the file's terms)
RENAMED = (
    ("request_defaults.", "engine_kwargs."),
    ("draft_resources.serve_options.", "deployment_config."),
    ("verifier_resources.serve_options.", "deployment_config."),
    ("draft_resources.", "deployment_config."),
    ("verifier_resources.", "deployment_config."),
    ("target.tp_size", "engine_kwargs.tensor_parallel_size"),
    ("target.source", "model_loading_config.model_source"),
    ("draft.source", "engine_kwargs.speculative_config.model"),
)
# AppArgs fields an `engine_kwargs` may set by their own names (the others have a field of
# Ray Serve LLM's own, or no meaning per model).
DSBD_FIELDS = ("layout", "limits", "default_max_tokens", "cost_policy", "session_affinity")
MODEL_FIELDS = ("device", "threads", "decode_path", "batch_invariant", "max_batch_size")
ENGINE_FIELDS = ("speculative_config", "tensor_parallel_size", "dtype")
# LLMConfig fields accepted only at Ray Serve LLM's default (what they ask for, dsbd has not).
DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "llm_engine": ("vLLM", "VLLM", "dsbd"),
    "lora_config": (None,),
    "server_cls": (None,),
    "accelerator_config": (None,),
    "runtime_env": (None,),
    "experimental_configs": ({},),
    "log_engine_metrics": (True, None),
    "callback_config": (None, {}),
}


class ModelLoadingConfig(BaseModel):
    """Which model, under which name (Ray Serve LLM's `ModelLoadingConfig`)."""

    model_config = ConfigDict(extra="forbid")

    model_id: str = Field(..., min_length=1, description="The name clients send as `model`.")
    model_source: str | None = Field(None, description="The target's weights; default model_id.")
    tokenizer_source: str | None = Field(
        None, description="Must be the model_source's own tokenizer (dsbd reads it from there)."
    )


class SpeculativeConfig(BaseModel):
    """vLLM's `speculative_config`, as much of it as names a draft and its depth."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="The draft: a source, or 'ngram'.")
    method: str | None = Field(None, description="'ngram', 'draft_model' or None.")
    num_speculative_tokens: int = Field(3, ge=1, le=32, description="Gamma's default and bound.")
    prompt_lookup_max: int | None = Field(None, description="The look-up's longest suffix.")
    prompt_lookup_min: int | None = Field(None, description="Accepted at 1 (dsbd matches 1..max).")


class LLMConfig(BaseModel):
    """One model (Ray Serve LLM's `LLMConfig`)."""

    model_config = ConfigDict(extra="forbid")

    model_loading_config: ModelLoadingConfig
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    deployment_config: dict[str, Any] = Field(default_factory=dict)
    accelerator_type: str | None = None
    placement_group_config: dict[str, Any] | None = None
    llm_engine: Any = None
    lora_config: Any = None
    server_cls: Any = None
    accelerator_config: Any = None
    runtime_env: Any = None
    experimental_configs: Any = Field(default_factory=dict)
    log_engine_metrics: Any = None
    callback_config: Any = None

    @field_validator(*DEFAULT_ONLY, mode="after")
    @classmethod
    def _default_only(cls, value: Any, info: Any) -> Any:
        allowed = DEFAULT_ONLY[info.field_name]
        if value not in allowed:
            raise ValueError(
                f"{info.field_name}={value!r}: {NOT_SUPPORTED}; {_why(info.field_name)}"
            )
        return value

    @field_validator("placement_group_config")
    @classmethod
    def _strategy_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in value or {}:
            if name != "strategy":
                raise ValueError(
                    f"placement_group_config.{name}: {NOT_SUPPORTED} (the tensor-parallel group "
                    "has one bundle per rank, sized by the model); allowed: strategy"
                )
        return value


class LLMServingArgs(BaseModel):
    """Several models behind one OpenAI ingress (Ray Serve LLM's `LLMServingArgs`)."""

    model_config = ConfigDict(extra="forbid")

    llm_configs: list[str | dict[str, Any]] = Field(..., min_length=1)
    ingress_deployment_config: dict[str, Any] = Field(default_factory=dict)
    ingress_cls_config: dict[str, Any] | None = None

    @field_validator("ingress_cls_config")
    @classmethod
    def _own_ingress(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError(f"ingress_cls_config: {NOT_SUPPORTED} (dsbd serves its own ingress)")
        return value


def _why(field: str) -> str:
    return {
        "llm_engine": "allowed: vLLM (the default, read as dsbd's engine) or dsbd",
        "lora_config": "dsbd serves whole models, no adapters",
        "server_cls": "dsbd's deployments are its own",
        "accelerator_config": "use accelerator_type",
        "runtime_env": "give it on the application (runtime_env of the Serve config's app)",
        "experimental_configs": "allowed: {} (none)",
        "log_engine_metrics": "dsbd's metrics are always exported (allowed: true)",
        "callback_config": "allowed: none",
    }[field]


def load_llm_config(entry: str | dict[str, Any], where: str) -> LLMConfig:
    """One `llm_configs` entry (a dict, or a path to a YAML file holding one)."""
    if isinstance(entry, str):
        path = Path(entry)
        try:
            entry = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"{where}={str(path)!r}: cannot read it as YAML: {error}") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{where}={str(path)!r}: not a mapping (one LLMConfig)")
    try:
        return LLMConfig.model_validate(entry)
    except ValidationError as error:
        raise ValueError(f"{where}.{_first(error)}") from None


def _first(error: ValidationError) -> str:
    """'field.path: message' of a validation error's first problem."""
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    message = error_words(first)
    if first["type"] == "extra_forbidden":
        message = f"{NOT_SUPPORTED} or misspelled (Ray Serve LLM's LLMConfig fields dsbd takes)"
    elif loc and message.startswith(loc.split(".")[-1]):
        return message if "." not in loc else f"{loc.rsplit('.', 1)[0]}.{message}"
    return f"{loc}: {message}" if loc else message


def app_args(config: LLMConfig, where: str) -> AppArgs:
    """The `AppArgs` of one `LLMConfig`: what `build_app` deploys for one model."""
    loading = config.model_loading_config
    source = loading.model_source or loading.model_id
    if loading.tokenizer_source not in (None, source):
        raise ValueError(
            f"{where}.model_loading_config.tokenizer_source={loading.tokenizer_source!r}: "
            f"{NOT_SUPPORTED} (the tokenizer is the model_source's own)"
        )
    kwargs = dict(config.engine_kwargs)
    knobs = set(DecodingKnobs.model_fields)
    allowed = sorted({*ENGINE_FIELDS, *DSBD_FIELDS, *MODEL_FIELDS, *knobs})
    for name in kwargs:
        if name not in allowed:
            raise ValueError(
                f"{where}.engine_kwargs.{name}: {NOT_SUPPORTED} (a vLLM engine option, or "
                f"misspelled); allowed: {', '.join(allowed)}"
            )
    try:
        speculative = SpeculativeConfig.model_validate(kwargs.get("speculative_config") or {})
    except ValidationError as error:
        raise ValueError(f"{where}.engine_kwargs.speculative_config.{_first(error)}") from None
    model = {name: kwargs[name] for name in MODEL_FIELDS if name in kwargs}
    if "dtype" in kwargs:
        model["dtype"] = kwargs["dtype"]
    target: dict[str, Any] = {"source": source, **model}
    draft: dict[str, Any] = {**model, **_draft(speculative, source, where)}
    if "tensor_parallel_size" in kwargs:
        target["tp_size"] = kwargs["tensor_parallel_size"]
    if config.placement_group_config:
        target["tp_placement"] = config.placement_group_config["strategy"]
    defaults = {name: kwargs[name] for name in knobs if name in kwargs}
    if speculative.model is not None or speculative.method is not None:
        defaults.setdefault("gamma", speculative.num_speculative_tokens)
    args: dict[str, Any] = {
        "model_name": loading.model_id,
        "target": target,
        "draft": draft,
        "request_defaults": defaults,
        **{name: kwargs[name] for name in DSBD_FIELDS if name in kwargs},
    }
    if speculative.model is not None or speculative.method is not None:
        limits = dict(args.get("limits") or {})
        limits.setdefault("max_gamma", speculative.num_speculative_tokens)
        args["limits"] = limits
    serve_options = dict(config.deployment_config)
    if config.accelerator_type is not None:
        target.setdefault("device", "cuda")
        draft.setdefault("device", "cuda")
        actor = dict(serve_options.get("ray_actor_options") or {})
        actor["accelerator_type"] = config.accelerator_type
        serve_options["ray_actor_options"] = actor
    gpus = 1.0 if target.get("device") == "cuda" and target.get("tp_size", 1) == 1 else 0.0
    draft_gpus = 1.0 if draft.get("device") == "cuda" else 0.0
    given = resources_from_serve_options(serve_options)  # Serve's options, each by its route
    args["verifier_resources"] = {"num_gpus": gpus, **given}
    args["draft_resources"] = {"num_gpus": draft_gpus, "num_cpus": 0.5, **given}
    try:
        return AppArgs.model_validate(args)
    except ValidationError as error:  # named as the LLMConfig names it
        written = _as_written(error, config.deployment_config)
        if written is not None:
            raise ValueError(f"{where}.{written}") from None
        message = _first(error)
        for ours, theirs in RENAMED:
            message = message.replace(ours, theirs)
        raise ValueError(f"{where}.{message}") from None


def _as_written(error: ValidationError, deployment_config: dict[str, Any]) -> str | None:
    """A typed `Resources` field's error named where the LLMConfig's `deployment_config` gave
    it (`num_replicas`, `autoscaling_config.max_replicas`, `ray_actor_options.num_cpus`, ...),
    with the value; None for any other error."""
    first = error.errors()[0]
    loc = first["loc"]
    message = error_words(first)
    if loc and loc[0] in ("draft_resources", "verifier_resources") and len(loc) == 1:
        return f"deployment_config.autoscaling_config: {message}"  # min above max replicas
    if len(loc) != 2 or loc[0] not in ("draft_resources", "verifier_resources"):
        return None
    for path, owner in OWNED.items():
        fields = ("min_replicas", "max_replicas") if path == ("num_replicas",) else (owner,)
        value: Any = deployment_config
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if loc[1] in fields and value is not None:
            return f"deployment_config.{'.'.join(path)}={value!r}: {message}"
    return None


def _draft(speculative: SpeculativeConfig, target: str, where: str) -> dict[str, Any]:
    """The draft's options from vLLM's speculative_config (none: the embedded default draft
    if the target is the embedded preset, else the prompt-lookup draft, which needs no
    weights)."""
    field = f"{where}.engine_kwargs.speculative_config"
    if speculative.method not in (None, "ngram", "draft_model"):
        raise ValueError(
            f"{field}.method={speculative.method!r}: {NOT_SUPPORTED}; allowed: ngram, "
            "draft_model (a model given by `model`)"
        )
    if speculative.prompt_lookup_min not in (None, 1):
        raise ValueError(
            f"{field}.prompt_lookup_min={speculative.prompt_lookup_min}: {NOT_SUPPORTED}; "
            "allowed: 1 (the look-up matches every suffix up to prompt_lookup_max)"
        )
    ngram = speculative.method == "ngram" or speculative.model == LOOKUP_DRAFT
    if ngram:
        draft: dict[str, Any] = {"source": LOOKUP_DRAFT}
        if speculative.prompt_lookup_max is not None:
            draft["variant"] = {"ngram_max": speculative.prompt_lookup_max}
        return draft
    if speculative.prompt_lookup_max is not None:
        raise ValueError(f"{field}.prompt_lookup_max: only with method: ngram")
    if speculative.model is not None:
        return {"source": speculative.model}
    return {"source": f"{target}-draft" if target == "smollm2" else LOOKUP_DRAFT}


def _suffix(model_id: str) -> str:
    """A Serve deployment name's tail for a model id (Serve names take no '/' or '#')."""
    return ":" + re.sub(r"[^A-Za-z0-9_.:-]", "_", model_id)


def serving_args(args: dict[str, Any] | LLMServingArgs) -> list[AppArgs]:
    """Each model's `AppArgs`, checked (ValueError naming the field)."""
    try:
        serving = LLMServingArgs.model_validate(args)
    except ValidationError as error:
        raise ValueError(_first(error)) from None
    models = [
        app_args(load_llm_config(entry, f"llm_configs[{i}]"), f"llm_configs[{i}]")
        for i, entry in enumerate(serving.llm_configs)
    ]
    names = [m.model_name for m in models]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(
                f"llm_configs[{i}].model_loading_config.model_id={name!r}: duplicate; model ids "
                "are unique"
            )
    return models


def build_openai_app(args: dict[str, Any] | LLMServingArgs) -> Application:
    """The Serve application for Ray Serve LLM's `LLMServingArgs` shape (a dict, as a Serve
    config's `args` gives it): every model's deployments behind one OpenAI ingress."""
    try:
        serving = LLMServingArgs.model_validate(args)
    except ValidationError as error:
        raise ValueError(_first(error)) from None
    models = serving_args(serving)
    inherited = _application_runtime_env()
    try:  # the ingress's Serve options, checked by Serve's own schema
        ingress = Resources.model_validate(
            {
                **AppArgs().ingress_resources.model_dump(),
                **resources_from_serve_options(serving.ingress_deployment_config),
            }
        )
    except ValidationError as error:
        message = _first(error).replace("serve_options.", "ingress_deployment_config.")
        raise ValueError(message) from None
    bound = [model_deployments(config, inherited, _suffix(config.model_name)) for config in models]
    options = ingress.options(
        inherited_env=inherited, allocator=models[0].allocator, kind="ingress"
    )
    return INGRESS.options(**options).bind(bound)


__all__ = ["LLMServingArgs", "build_openai_app", "serving_args"]
