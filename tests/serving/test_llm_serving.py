"""Ray Serve LLM's config shape (deployments/llm_serving.py), without Ray: what each field of
an `LLMServingArgs` becomes, and the error that names a field dsbd does not take. The served
path (`serve run` of such a YAML, two models behind one ingress, the openai client) is in
tests/serving/test_serve_run.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.llm_serving import build_openai_app, serving_args

# Ray's own example (docs: "Serving LLMs", build_openai_app), with dsbd's draft and knobs
RAY_EXAMPLE = """
llm_configs:
  - model_loading_config:
      model_id: qwen-0.5b
      model_source: smollm2
    deployment_config:
      autoscaling_config:
        min_replicas: 1
        max_replicas: 2
    accelerator_type: A10G
    engine_kwargs:
      speculative_config:
        model: smollm2-draft
        num_speculative_tokens: 4
      width: 4
      adaptive: false
  - model_loading_config:
      model_id: lookup
      model_source: smollm2
    engine_kwargs:
      speculative_config:
        method: ngram
        prompt_lookup_max: 5
      method: beam
      tensor_parallel_size: 2
    placement_group_config:
      strategy: SPREAD
ingress_deployment_config:
  max_ongoing_requests: 128
"""


def test_each_field_of_ray_serve_llms_shape_lands_where_it_says() -> None:
    first, second = serving_args(yaml.safe_load(RAY_EXAMPLE))
    assert first.model_name == "qwen-0.5b" and first.target.source == "smollm2"
    assert first.draft.source == "smollm2-draft"
    assert first.request_defaults == {"width": 4, "adaptive": False, "gamma": 4}
    assert first.limits.max_gamma == 4  # num_speculative_tokens: gamma's bound
    assert first.target.device == first.draft.device == "cuda"  # accelerator_type: a GPU
    assert first.colocated  # one GPU, no TP: one pair replica owns both models
    options = first.verifier_resources.options(first.target)
    assert options["ray_actor_options"]["accelerator_type"] == "A10G"
    assert options["ray_actor_options"]["num_gpus"] == 1
    assert options["autoscaling_config"]["max_replicas"] == 2
    assert second.draft.source == "ngram" and second.draft.variant.ngram_max == 5
    assert second.request_defaults == {"method": "beam", "gamma": 3}
    assert second.target.tp_size == 2 and second.target.tp_placement == "SPREAD"
    assert not second.colocated  # CPU and tensor-parallel: the split layout
    assert build_openai_app(yaml.safe_load(RAY_EXAMPLE)) is not None


def test_llm_configs_may_be_paths_to_yaml_files(tmp_path: Path) -> None:
    entry = yaml.safe_load(RAY_EXAMPLE)["llm_configs"][1]
    (tmp_path / "lookup.yaml").write_text(yaml.safe_dump(entry))
    (only,) = serving_args({"llm_configs": [str(tmp_path / "lookup.yaml")]})
    assert only.model_name == "lookup" and only.draft.source == "ngram"


def _one(**fields) -> dict:
    return {"llm_configs": [{"model_loading_config": {"model_id": "m"}, **fields}]}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            _one(engine_kwargs={"max_model_len": 8192}),
            "llm_configs[0].engine_kwargs.max_model_len: not supported by dsbd",
        ),
        (_one(lora_config={"max_num_adapters_per_replica": 2}), "lora_config="),
        (_one(runtime_env={"pip": ["x"]}), "give it on the application"),
        (_one(enigne_kwargs={}), "llm_configs[0].enigne_kwargs: not supported by dsbd or misspel"),
        (
            {"llm_configs": [{"model_loading_config": {"model_id": "m", "model_sorce": "x"}}]},
            "model_loading_config.model_sorce",
        ),
        (_one(engine_kwargs={"width": 0}), "llm_configs[0].engine_kwargs.width=0"),
        (
            _one(engine_kwargs={"speculative_config": {"method": "eagle"}}),
            "speculative_config.method='eagle': not supported by dsbd; allowed: ngram",
        ),
        (_one(deployment_config={"num_replica": 2}), "deployment_config.num_replica: not a Ray"),
        (_one(deployment_config={"num_replicas": 0}), "deployment_config.num_replicas=0: Input"),
        (
            _one(deployment_config={"autoscaling_config": {"max_replicas": 0}}),
            "deployment_config.autoscaling_config.max_replicas=0: Input should be greater",
        ),
        (
            _one(deployment_config={"ray_actor_options": {"num_cpus": -1}}),
            "deployment_config.ray_actor_options.num_cpus=-1: Input should be greater",
        ),
        (
            _one(deployment_config={"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}),
            "deployment_config.autoscaling_config: min_replicas=3 > max_replicas=2; allowed",
        ),
        (_one(placement_group_config={"bundles": [{"GPU": 1}]}), "placement_group_config.bundl"),
        (
            {"llm_configs": [{"model_loading_config": {"model_id": "m"}}] * 2},
            "llm_configs[1].model_loading_config.model_id='m': duplicate",
        ),
        ({"llm_configs": []}, "llm_configs: List should have at least 1 item"),
        ({"llm_configs": ["/no/such.yaml"]}, "llm_configs[0]='/no/such.yaml': cannot read it"),
        (
            {**_one(), "ingress_deployment_config": {"replicas": 2}},
            "ingress_deployment_config.replicas: not a Ray Serve deployment option",
        ),
        ({**_one(), "ingress_cls_config": {"ingress_cls": "x"}}, "ingress_cls_config: not supp"),
    ],
)
def test_what_dsbd_does_not_take_is_an_error_naming_the_field(args: dict, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        build_openai_app(args)
    assert message in str(raised.value), str(raised.value)


def test_dsbd_serve_takes_the_same_file_and_its_flags(tmp_path: Path) -> None:
    """`dsbd serve --config` reads Ray Serve LLM's shape; its flags go into every model's
    engine_kwargs; a field dsbd does not take exits 2 naming it."""
    from dsbd.serve_command import load_config

    app = {
        "name": "llm",
        "import_path": "deployments.llm_serving:build_openai_app",
        "args": yaml.safe_load(RAY_EXAMPLE),
    }
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump({"applications": [app]}))
    schema = load_config(tmp_path / "serve.yaml", "127.0.0.1", 8000, 1, layout="split")
    configs = schema.applications[0].args["llm_configs"]
    assert [c["engine_kwargs"]["layout"] for c in configs] == ["split", "split"]
    assert [c["engine_kwargs"]["tensor_parallel_size"] for c in configs] == [1, 1]
    first, _ = serving_args(schema.applications[0].args)
    assert not first.colocated  # the flag won over accelerator_type's auto
    app["args"]["llm_configs"][0]["engine_kwargs"]["max_num_seqs"] = 8
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump({"applications": [app]}))
    with pytest.raises(SystemExit) as exited:
        load_config(tmp_path / "serve.yaml", "127.0.0.1", 8000)
    assert exited.value.code == 2
