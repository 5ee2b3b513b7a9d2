"""The cluster files (cluster/): KubeRay manifests and the VM cluster config.

No Kubernetes API server, Docker or GPU exists here, so what can be checked offline is checked
against the real thing each file is read by:

* every manifest against the openAPIV3Schema of its KubeRay CRD (cluster/crds/, vendored from
  KubeRay), with Kubernetes' semantics (cluster/crd_schema.py) and the operator's own checks;
  the validator is shown to refuse what Kubernetes refuses;
* the RayService's serveConfigV2 against serve_config.yaml (no drift beyond
  cluster/serve-overrides.yaml), Ray Serve's `ServeDeploySchema` and the project's `AppArgs`;
* the GPUs of the pod groups against `tp_size`, the replica maxima and the draft's resources;
* the VM cluster config against Ray's own cluster-config schema (ray/autoscaler/ray-schema.json)
  and the defaults `ray up` fills in.

The Grafana dashboard is checked in tests/cluster/test_cluster_dashboard.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
sys.path.insert(0, str(CLUSTER))  # cluster/*.py are scripts, not an installed package

import crd_schema  # noqa: E402
import serve_sync  # noqa: E402

MANIFESTS = ["rayservice.yaml", "rayservice-llm.yaml", "rayjob-batch.yaml"]
VM_CONFIG = CLUSTER / "ray-cluster.aws.yaml"
IMAGE = "dsbd:0.1.0-gpu"


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CLUSTER / name).read_text())


def cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"].get("rayClusterConfig") or doc["spec"]["rayClusterSpec"]


def serve_app(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = [a for a in config["applications"] if a["import_path"] == "deployments.app:build_app"]
    return app


def custom_resources(params: dict[str, str]) -> dict[str, float]:
    """rayStartParams.resources: a JSON object inside shell quotes, as KubeRay documents it."""
    text = params.get("resources")
    return json.loads(json.loads(text)) if text else {}


def group_resources(group: dict[str, Any]) -> dict[str, float]:
    """What the Ray node of one pod advertises, after checking it matches the pod's limits."""
    params = group["rayStartParams"]
    (container,) = group["template"]["spec"]["containers"]
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    gpus = int(limits.get("nvidia.com/gpu", 0))
    assert requests.get("nvidia.com/gpu", "0") == limits.get("nvidia.com/gpu", "0")
    assert int(params.get("num-gpus", 0)) == gpus, "num-gpus must equal the nvidia.com/gpu limit"
    cpus = float(params.get("num-cpus", limits["cpu"]))
    assert cpus <= float(limits["cpu"]), "Ray may not schedule more CPUs than the pod has"
    return {"CPU": cpus, "GPU": gpus, **custom_resources(params)}


def replicas_fitting(node: dict[str, float], demands: list[dict[str, float]]) -> int:
    """How many of `demands` (resource dicts, packed together) fit on `node`, at most once each."""
    left, count = dict(node), 0
    for demand in demands:
        if all(left.get(k, 0) >= v for k, v in demand.items()):
            left = {k: v - demand.get(k, 0) for k, v in left.items()}
            count += 1
    return count


def verifier_and_draft_demands(args: Any) -> tuple[dict[str, float], dict[str, float]]:
    """The verifier's placement group (summed: STRICT_PACK puts it on ONE node) and a draft's
    resources, exactly as deployments.app builds them for Serve."""
    verifier = args.verifier_resources.options(args.target)
    strategy = verifier.get("placement_group_strategy", "STRICT_PACK")
    assert strategy == "STRICT_PACK", "this sizing assumes one node per verifier replica"
    group: dict[str, float] = {}
    alone = [{"CPU": args.verifier_resources.num_cpus}]  # tp_size 1: no placement group
    for bundle in verifier.get("placement_group_bundles", alone):
        for key, value in bundle.items():
            group[key] = group.get(key, 0) + value
    actor = args.draft_resources.options(args.draft)["ray_actor_options"]
    draft = {"CPU": actor["num_cpus"], "GPU": actor.get("num_gpus", 0)}
    draft.update(actor.get("resources", {}))
    return group, draft


@pytest.fixture(scope="module")
def app_args() -> Any:
    from deployments.app import AppArgs

    return AppArgs.model_validate(serve_app(embedded_serve_config())["args"])


def embedded_serve_config() -> dict[str, Any]:
    return serve_sync.embedded((CLUSTER / "rayservice.yaml").read_text())


# ----------------------------------------------------------------------------- the CRD schemas
def test_vendored_crds_are_the_kuberay_copies_the_readme_names() -> None:
    readme = (CLUSTER / "crds" / "README.md").read_text()
    assert "feeaf72" in readme
    for name in [*crd_schema.CRD_FILES.values(), "LICENSE"]:
        digest = hashlib.sha256((CLUSTER / "crds" / name).read_bytes()).hexdigest()
        assert f"| {name} | `{digest}` |" in readme, f"{name} changed: update crds/README.md"
        shared = REPO.parent / "shared" / "kuberay-crds" / name
        if shared.is_file():  # the copy this project was given, where it is present
            assert shared.read_bytes() == (CLUSTER / "crds" / name).read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_matches_its_kuberay_crd(name: str) -> None:
    documents = list(yaml.safe_load_all((CLUSTER / name).read_text()))
    assert len(documents) == 1 and documents[0]["apiVersion"] == "ray.io/v1"
    assert crd_schema.manifest_errors(documents[0]) == []


# Fields the CRD still accepts but KubeRay ignores ("Deprecated: This field is not used
# anymore", ray-project/kuberay#1688): setting one suggests a behaviour that does not exist.
IGNORED_BY_KUBERAY = {
    "RayService": ("deploymentUnhealthySecondThreshold", "serviceUnhealthySecondThreshold"),
}


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_sets_no_field_kuberay_ignores(name: str) -> None:
    doc = load(name)
    for field in IGNORED_BY_KUBERAY.get(doc["kind"], ()):
        assert field not in doc["spec"], f"{name}: spec.{field} is deprecated and unused"


@pytest.mark.slow  # over a second: outside the quick loop
def test_validator_refuses_what_kubernetes_and_kuberay_refuse() -> None:
    """Each mutation is a mistake the API server or the operator would reject."""
    good = load("rayservice.yaml")
    head = ["spec", "rayClusterConfig", "headGroupSpec"]
    container = [*head, "template", "spec", "containers", 0]

    def mutated(path: list[Any], change: Any) -> dict[str, Any]:
        doc = copy.deepcopy(good)
        node = doc
        for key in path[:-1]:
            node = node[key]
        change(node, path[-1])
        return doc

    def setter(value: Any) -> Any:
        return lambda node, key: node.__setitem__(key, value)

    cases = {
        "'rayStartParam' was unexpected": mutated([*head, "rayStartParam"], setter({})),
        "is not of type 'string'": mutated([*head, "rayStartParams", "num-cpus"], setter(2)),
        "0.5 is not valid under any of the given schemas": mutated(
            [*container, "resources", "limits", "cpu"], setter(0.5)
        ),
        "does not match": mutated([*container, "resources", "limits", "memory"], setter("16 GB")),
        "duplicate item with {'containerPort': 8000, 'protocol': 'TCP'}": mutated(
            [*container, "ports"], lambda n, k: n[k].append({"containerPort": 8000})
        ),
        "is not one of ['Default', 'Aggressive', 'Conservative']": mutated(
            ["spec", "rayClusterConfig", "autoscalerOptions", "upscalingMode"], setter("Fast")
        ),
        "must be either 'ray.io/kuberay-operator'": mutated(["spec", "managedBy"], setter("me")),
        "'status' was unexpected": mutated(["status"], setter({})),
        "does not match '^[a-z]": mutated(["metadata", "name"], setter("DSBD_service")),
        "longer than 47 characters": mutated(["metadata", "name"], setter("d" * 48)),
        "resources set in rayStartParams and resources": mutated(
            [*head, "resources"], setter({"CPU": "2"})
        ),
        "need minReplicas <= replicas <= maxReplicas": mutated(
            ["spec", "rayClusterConfig", "workerGroupSpecs", 0, "replicas"], setter(9)
        ),
        "2147483648 is not a 'int32'": mutated(
            ["spec", "rayClusterDeletionDelaySeconds"], setter(2**31)
        ),
    }
    for expected, doc in cases.items():
        errors = crd_schema.manifest_errors(doc)
        assert any(expected in e for e in errors), (expected, errors)
    job = load("rayjob-batch.yaml")
    job["spec"]["shutdownAfterJobFinishes"] = False
    job["spec"]["deletionStrategy"] = {"onSuccess": {"policy": "DeleteCluster"}}  # no onFailure
    errors = crd_schema.manifest_errors(job)
    assert any("requires either BOTH onSuccess and onFailure" in e for e in errors), errors
    assert any("ttlSecondsAfterFinished needs shutdownAfterJobFinishes" in e for e in errors)


def test_an_unknown_cel_rule_fails_instead_of_being_skipped(monkeypatch: Any) -> None:
    monkeypatch.delitem(crd_schema.CEL_RULES, "self == oldSelf")
    crd_schema._validator.cache_clear()
    try:
        doc = load("rayservice.yaml")
        doc["spec"]["managedBy"] = "ray.io/kuberay-operator"
        errors = crd_schema.schema_errors(doc)
        assert any("has no translation in CEL_RULES" in e for e in errors), errors
    finally:
        crd_schema._validator.cache_clear()


# ----------------------------------------------------------------- serveConfigV2 and the app
def test_serve_config_v2_is_serve_config_yaml_plus_the_cluster_overrides() -> None:
    text = (CLUSTER / "rayservice.yaml").read_text()
    drift = serve_sync.differences(serve_sync.embedded(text), serve_sync.cluster_serve_config())
    assert drift == [], "run: python cluster/serve_sync.py write\n" + "\n".join(drift)
    # ... and the block is exactly what the generator writes (its header included).
    assert serve_sync.replace_block(text, serve_sync.render()) == text
    done = subprocess.run(
        [sys.executable, str(CLUSTER / "serve_sync.py"), "check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout


def test_the_llm_manifest_carries_ray_serve_llms_block_and_gpus_for_its_models() -> None:
    """cluster/rayservice-llm.yaml: serveConfigV2 is serve_config.llm.yaml (Ray Serve LLM's
    `llm_configs`) plus its overrides, valid for Serve and for deployments.llm_serving; every
    model runs co-located on one A10G, and the `gpu` pods hold every pair replica at the
    models' autoscaling maxima, one per pod."""
    from ray.serve.schema import ServeDeploySchema

    from deployments.llm_serving import serving_args

    manifest = CLUSTER / "rayservice-llm.yaml"
    text = manifest.read_text()
    drift = serve_sync.differences(
        serve_sync.embedded(text), serve_sync.cluster_serve_config(manifest)
    )
    assert drift == [], "run: python cluster/serve_sync.py write\n" + "\n".join(drift)
    assert serve_sync.replace_block(text, serve_sync.render(manifest)) == text
    config = serve_sync.embedded(text)
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    models = serving_args(app["args"])
    assert [m.model_name for m in models] == ["smollm2", "smollm2-lookup"]
    pairs = 0
    for model in models:
        assert model.colocated and model.target.device == model.draft.device == "cuda"
        options = model.verifier_resources.options(model.target)
        assert options["ray_actor_options"]["accelerator_type"] == "A10G"
        assert options["ray_actor_options"]["num_gpus"] == 1
        pairs += options["autoscaling_config"]["max_replicas"]
    (group,) = cluster_spec(load("rayservice-llm.yaml"))["workerGroupSpecs"]
    node = group_resources(group)
    pair = {"CPU": models[0].verifier_resources.num_cpus, "GPU": 1}
    assert replicas_fitting(node, [pair] * 4) == 1, "one pair replica per GPU pod"
    assert group["maxReplicas"] >= pairs


def test_drift_is_reported_with_its_path() -> None:
    text = (CLUSTER / "rayservice.yaml").read_text()
    edited = text.replace("max_ongoing_requests: 256", "max_ongoing_requests: 512", 1)
    assert edited != text
    drift = serve_sync.differences(serve_sync.embedded(edited), serve_sync.cluster_serve_config())
    assert drift == [
        "applications[0].args.ingress_resources.serve_options.max_ongoing_requests: manifest 512,"
        " merge 256"
    ]
    with pytest.raises(ValueError, match=r"applications\[name='other'\] is not in"):
        serve_sync.merge({"applications": [{"name": "a"}]}, {"applications": [{"name": "other"}]})


def test_cluster_serve_config_is_valid_for_serve_and_for_the_app(app_args: Any) -> None:
    from ray.serve.schema import ServeDeploySchema

    config = embedded_serve_config()
    schema = ServeDeploySchema.model_validate(config)
    assert schema.http_options.host == "0.0.0.0" and schema.http_options.port == 8000
    assert app_args.target.device == "cuda" and app_args.draft.device == "cuda"
    # What the overrides change is exactly what the file says, nothing else.
    base = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    overrides = yaml.safe_load((CLUSTER / "serve-overrides.yaml").read_text())
    changed = serve_sync.differences(config, base)
    assert {c.split(":")[0] for c in changed} == {
        "http_options.host",
        "applications[0].args.target.device",
        "applications[0].args.target.tp_size",
        "applications[0].args.draft.device",
        "applications[0].args.draft_resources.num_gpus",
        "applications[0].args.draft_resources.resources",
    }, changed
    assert overrides["applications"][0]["name"] == serve_app(base)["name"]


def test_custom_resources_reach_the_replica_and_its_placement_group() -> None:
    from deployments.app import AppArgs
    from deployments.deployment_options import Resources
    from deployments.replicas.model_options import ModelOptions

    draft = Resources(num_cpus=0.5, num_gpus=1, resources={"dsbd_draft": 1})
    assert draft.options()["ray_actor_options"] == {
        "num_cpus": 0.5,
        "num_gpus": 1,
        "resources": {"dsbd_draft": 1},
    }
    model = ModelOptions(source="smollm2", device="cuda", tp_size=2)
    bundles = Resources(resources={"pinned": 1}).options(model)["placement_group_bundles"]
    assert bundles == [{"CPU": 1.0, "pinned": 1}] + [{"CPU": 1.0, "GPU": 1.0}] * 2
    for bad, message in [({"GPU": 1}, "use num_cpus/num_gpus"), ({"x": 0}, "must be > 0")]:
        with pytest.raises(ValueError, match=message):
            AppArgs.model_validate({"draft_resources": {"resources": bad}})


# ------------------------------------------------------------------------- GPUs and tp_size
def test_rayservice_gpus_cover_tp_size_and_the_replica_maxima(app_args: Any) -> None:
    spec = cluster_spec(load("rayservice.yaml"))
    tp = app_args.target.tp_size
    verifier, draft = verifier_and_draft_demands(app_args)
    assert tp > 1 and verifier["GPU"] == tp and draft["GPU"] == app_args.draft_resources.num_gpus
    head = group_resources(spec["headGroupSpec"])
    assert head["GPU"] == 0 and replicas_fitting(head, [verifier]) == 0
    assert replicas_fitting(head, [draft]) == 0, "a draft replica must not fit on the head"
    need_verifiers = app_args.verifier_resources.max_replicas
    need_drafts = app_args.draft_resources.max_replicas
    verifiers = drafts = gpus = 0
    for group in spec["workerGroupSpecs"]:
        node = group_resources(group)
        assert node["GPU"] > 0, f"{group['groupName']}: every worker group is a GPU group"
        fits_verifier = replicas_fitting(node, [verifier])
        fits_draft = replicas_fitting(node, [draft] * 8)
        if fits_verifier:
            assert node["GPU"] >= tp and node["GPU"] % tp == 0, "pods hold whole TP groups"
            # A draft must never take a GPU a verifier pod needs: drafts fit no verifier pod.
            assert fits_draft == 0, f"{group['groupName']}: drafts could land on verifier pods"
        verifiers += fits_verifier * group["maxReplicas"]
        drafts += fits_draft * group["maxReplicas"]
        gpus += node["GPU"] * group["maxReplicas"]
        assert fits_verifier or fits_draft, f"{group['groupName']}: no replica fits its pods"
    assert verifiers >= need_verifiers and drafts >= need_drafts
    assert gpus >= need_verifiers * tp + need_drafts * draft["GPU"]
    # minReplicas keep one of each up, so the app can start before the autoscaler acts.
    started = [g for g in spec["workerGroupSpecs"] if g["minReplicas"] >= 1]
    kinds = {bool(replicas_fitting(group_resources(g), [verifier])) for g in started}
    assert kinds == {True, False}


def test_vm_cluster_nodes_cover_tp_size_and_the_replica_maxima(app_args: Any) -> None:
    config = yaml.safe_load(VM_CONFIG.read_text())
    verifier, draft = verifier_and_draft_demands(app_args)
    nodes = config["available_node_types"]
    head = nodes[config["head_node_type"]]["resources"]
    assert head.get("GPU", 0) == 0 and replicas_fitting(head, [draft]) == 0
    verifiers = drafts = 0
    for name, node in nodes.items():
        if name == config["head_node_type"]:
            continue
        fits_verifier = replicas_fitting(node["resources"], [verifier])
        # Drafts pack beside the verifier: the node must hold both at once.
        both = replicas_fitting(node["resources"], [verifier] * fits_verifier + [draft] * 8)
        verifiers += fits_verifier * node["max_workers"]
        drafts += (both - fits_verifier) * node["max_workers"]
    assert verifiers >= app_args.verifier_resources.max_replicas
    assert drafts >= app_args.draft_resources.max_replicas
    assert config["max_workers"] >= sum(
        n.get("max_workers", 0) for k, n in nodes.items() if k != config["head_node_type"]
    )


def test_batch_rayjob_runs_dsbd_batch_on_its_gpus() -> None:
    from dsbd.cli import build_parser

    job = load("rayjob-batch.yaml")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["dsbd", "batch"]
    args = build_parser().parse_args(argv[1:])  # the real CLI: every flag must exist
    assert args.device == "cuda" and args.input.startswith("/data/")
    assert args.output.startswith("/data/")
    spec = cluster_spec(job)
    actor = {"CPU": args.num_cpus, "GPU": args.num_gpus}
    assert group_resources(spec["headGroupSpec"])["GPU"] == 0
    actors = sum(
        replicas_fitting(group_resources(g), [actor] * 8) * g["replicas"]
        for g in spec["workerGroupSpecs"]
    )
    assert actors >= args.concurrency, "the pods cannot hold --concurrency decoding actors"
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        assert claims[mounts["/data"]] == "dsbd-batch-data", "every pod must see --input/--output"


# ------------------------------------------------------------------- image and Ray versions
def test_one_image_and_one_ray_version_everywhere() -> None:
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert f"ARG RAY_VERSION={ray.__version__}" in dockerfile
    assert "FROM rayproject/ray:${RAY_VERSION}-${RAY_FLAVOR}" in dockerfile
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert f"ARG RAY_FLAVOR={python}-gpu" in dockerfile, "the image's Python must be the project's"
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text()
    assert '"torch==2.13.0"' in dockerfile
    for name in MANIFESTS:
        spec = cluster_spec(load(name))
        assert spec["rayVersion"] == ray.__version__
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
        assert images == {IMAGE}, name
    assert yaml.safe_load(VM_CONFIG.read_text())["docker"]["image"] == IMAGE


def test_the_head_gives_rays_gcs_the_memory_settings_dsbd_serve_gives_it() -> None:
    """The GCS runs on the head pod: its jemalloc settings and history caps are those of
    `dsbd serve`'s local Ray (deployments/local_ray.py, docs/RELIABILITY.md section 10); every
    pod's own Ray processes get its glibc arenas."""
    from deployments.local_ray import GLIBC_MALLOC_ARENAS, ray_process_environment

    for name in MANIFESTS:
        (head,) = cluster_spec(load(name))["headGroupSpec"]["template"]["spec"]["containers"]
        env = {item["name"]: item["value"] for item in head["env"]}
        assert ray_process_environment().items() <= env.items(), name
        for group in cluster_spec(load(name))["workerGroupSpecs"]:  # every node's own processes
            for container in group["template"]["spec"]["containers"]:
                env = {item["name"]: item["value"] for item in container["env"]}
                assert env["MALLOC_ARENA_MAX"] == GLIBC_MALLOC_ARENAS, (name, group["groupName"])
    # the VM cluster's nodes run Ray in one container each (docker run --env NAME=value)
    options = yaml.safe_load(VM_CONFIG.read_text())["docker"]["run_options"]
    env = dict(o.removeprefix("--env ").split("=", 1) for o in options if o.startswith("--env "))
    assert ray_process_environment().items() <= env.items()


def test_the_gcs_keeps_its_tables_in_the_redis_beside_it() -> None:
    """GCS fault tolerance (issue 50): each RayService's GCS uses the Redis of
    cluster/redis.yaml (its Service's name and port, its Secret's key), with Redis's
    append-only file on a volume and a password; no namespace (KubeRay then takes the
    RayCluster's UID: a NewCluster upgrade never reads the old cluster's tables); the head
    retries Redis as `dsbd serve --gcs-redis` does."""
    from deployments.gcs_ft import REDIS_RETRIES

    pvc, deployment, service = yaml.safe_load_all((CLUSTER / "redis.yaml").read_text())
    assert [pvc["kind"], deployment["kind"], service["kind"]] == [
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (secret,) = [e["valueFrom"]["secretKeyRef"] for e in container["env"]]
    command = " ".join(container["args"])
    assert "--appendonly yes" in command and '--requirepass "$REDIS_PASSWORD"' in command
    (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert container["volumeMounts"][0]["mountPath"] in command
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == labels == deployment["spec"]["selector"]["matchLabels"]
    (port,) = service["spec"]["ports"]
    for name in ("rayservice.yaml", "rayservice-llm.yaml"):
        options = cluster_spec(load(name))["gcsFaultToleranceOptions"]
        assert options["redisAddress"] == f"{service['metadata']['name']}:{port['port']}", name
        assert options["redisPassword"]["valueFrom"]["secretKeyRef"] == secret, name
        assert "externalStorageNamespace" not in options, name
        (head,) = cluster_spec(load(name))["headGroupSpec"]["template"]["spec"]["containers"]
        env = {item["name"]: item.get("value") for item in head["env"]}
        assert REDIS_RETRIES.items() <= env.items(), name


# --------------------------------------------------------------------------- VM cluster config
def test_vm_cluster_config_matches_rays_cluster_schema() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(VM_CONFIG.read_text())
    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.validate(config, schema)  # the file as written
    validate_config(prepare_config(copy.deepcopy(config)))  # as `ray up` completes it
    typo = copy.deepcopy(config)
    typo["available_node_types"]["gpu_tp3"]["resource"] = {"GPU": 4}
    with pytest.raises(jsonschema.ValidationError, match="'resource' was unexpected"):
        jsonschema.validate(typo, schema)
