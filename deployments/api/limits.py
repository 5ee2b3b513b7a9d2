"""What the router is configured with (`RouterOptions`), and what one request may ask of it
(`Limits`, checked before any model work: HTTP 400/429).

`check_config` names the request's own fields in its errors, with the value given and the
server's configured limit, so a client can fix the request without reading the server config.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.api.admission import check_fits
from deployments.api.errors import APIError
from dsbd_core.algorithm.config import SamplingConfig
from dsbd_core.algorithm.methods import MethodConfig, MethodConfigError, method_config


class Limits(BaseModel):
    """What one request may ask of this server (checked before any model work: HTTP 400/429)."""

    model_config = ConfigDict(extra="forbid")

    max_prompt_tokens: int = Field(4096, ge=1, description="Prompt length in tokens.")
    max_new_tokens: int = Field(1024, ge=1, description="max_tokens / max_new_tokens.")
    max_width: int = Field(16, ge=1, description="Beam width W.")
    max_draft_width: int = Field(32, ge=1, description="Draft beams per layer W_S.")
    max_gamma: int = Field(8, ge=0, description="Draft depth.")
    max_n: int = Field(16, ge=1, description="Beams returned (OpenAI n).")
    max_concurrent_sessions: int = Field(
        256, ge=1, description="Decodes one ingress replica admits at once; more get HTTP 429."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="A decode still running after this is stopped: HTTP 504."
    )


class RouterOptions(BaseModel):
    """What the ingress needs besides the handles."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("smollm2", description="The id /v1/models lists and requests name.")
    tokenizer: str = Field("smollm2", description="Where the target's tokenizer is read from.")
    default_max_tokens: int = Field(64, ge=1, le=32768)
    limits: Limits = Limits()
    api_key_file: str | None = Field(
        None,
        description="A file holding the API key clients must send (Bearer); without it, "
        "the DSBD_API_KEY environment variable; neither: no key. Never the key itself: Serve "
        "logs its application arguments.",
    )
    router_replicas: int = Field(
        1,
        ge=1,
        description="The ingress deployment's max_replicas: each ingress replica admits decodes "
        "against this share of the replicas' session memory (deployments/api/admission.py).",
    )
    request_defaults: dict[str, Any] = Field(
        default_factory=dict,
        description="Request fields (the HTTP API's names: method, width, gamma, threshold, "
        "adaptive, ...) a request gets when it does not set them: an `llm_configs` entry's "
        "dsbd knobs (deployments/llm_serving.py).",
    )
    colocated: bool = Field(
        False,
        description="The router, draft and verifier handles are one Pair deployment's "
        "(deployments/decode/pair.py): the models' info is read through it.",
    )


def check_config(
    config: SamplingConfig,
    method: str,
    prompt_ids: list[int],
    info: dict,
    limits: Limits,
    tokens_field: str,
) -> MethodConfig:
    """The method's config, checked against `limits` and what the model (`info`, the verifier's
    vocab_size and max_positions, and `admission`: the replicas' session memory as this router
    shares it) can hold; see `Ingress._config` for the fields it names."""
    vocab = int(info["vocab_size"])
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400, f"prompt_ids: token id {bad[0]} out of range; allowed 0..{vocab - 1}", "prompt_ids"
        )
    try:
        config = method_config(method, config)
    except MethodConfigError as error:
        raise APIError(400, str(error), error.field) from None
    draft_field = "draft_width" if config.draft_width is not None else "width"
    for field, value, limit, name in (
        ("prompt", len(prompt_ids), limits.max_prompt_tokens, "max_prompt_tokens"),
        (tokens_field, config.max_new_tokens, limits.max_new_tokens, "max_new_tokens"),
        ("width", config.width, limits.max_width, "max_width"),
        (draft_field, config.effective_draft_width, limits.max_draft_width, "max_draft_width"),
        (
            "gamma",
            config.draft_depth,
            limits.max_gamma,
            "max_gamma",
        ),
    ):
        if value > limit:
            shown = f"prompt of {value} tokens" if field == "prompt" else f"{field}={value}"
            raise APIError(400, f"{shown} exceeds this server's limit {name}={limit}", field)
    gamma = config.draft_depth
    needed = len(prompt_ids) + config.max_new_tokens + gamma + 1
    limit = int(info["max_positions"])
    if needed > limit:
        raise APIError(
            400,
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({config.max_new_tokens}) + gamma "
            f"({gamma}) + 1 = {needed} exceeds the model's {limit} positions; allowed: a "
            f"shorter prompt or a smaller {tokens_field}",
            tokens_field,
        )
    check_fits(config, len(prompt_ids), info.get("admission"), tokens_field)
    return config
