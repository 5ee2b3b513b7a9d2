"""Validate KubeRay manifests offline, as the Kubernetes API server and the operator would.

No API server runs on the machines this project is built on, so the manifests in `cluster/` are
checked here against the real `openAPIV3Schema` of their CRD (`cluster/crds/`, vendored from
KubeRay) with `jsonschema`. A CRD schema is OpenAPI v3 plus Kubernetes extensions; each is given
its Kubernetes meaning rather than dropped:

* unknown fields: the API server prunes them, and `kubectl apply` (field validation "strict",
  its default) refuses them. A typo such as `rayStartParam` must fail, so every object schema
  without `additionalProperties` or `x-kubernetes-preserve-unknown-fields` is closed.
* `x-kubernetes-int-or-string`: the schema already says `anyOf: [integer, string]` plus the
  quantity `pattern`, which JSON Schema applies to strings only, exactly as Kubernetes does.
  So `cpu: 0.5` (a float) is refused as it is by a real CRD, and `cpu: "500m"` passes.
* `format: int32/int64`: range-checked. `nullable: true`: null accepted.
* `x-kubernetes-list-type: map | set`: items unique by their `x-kubernetes-list-map-keys`
  (defaults applied first, e.g. a port's `protocol: TCP`) or by value.
* `x-kubernetes-validations` (CEL): the rules these CRDs carry are translated in `CEL_RULES`;
  a rule not found there FAILS validation instead of being skipped (`self == oldSelf` is a
  transition rule: Kubernetes evaluates it only on update, so it holds on create).
* `metadata` is `type: object` in every CRD (the API server validates ObjectMeta itself): it is
  checked here as KubeRay requires (name a DNS-1035 label, at most 47/53 characters).

`kuberay_errors` adds a subset of the operator's own admission checks
(ray-operator/controllers/ray/utils/validation.go) that the schema cannot express.

    python cluster/crd_schema.py cluster/*.yaml     # prints each problem; exit 1 if any
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from jsonschema import Draft4Validator, FormatChecker, validators

CRD_DIR = Path(__file__).resolve().parent / "crds"
API_VERSION = "ray.io/v1"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
# KubeRay's constant.go: the cluster name gets "-serve-svc" (10) appended, a RayService's or
# RayJob's name 6 more characters for the RayCluster it creates.
MAX_NAME_LENGTH = {"RayCluster": 53, "RayJob": 47, "RayService": 47}
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _has(obj: Any, field: str) -> bool:
    return isinstance(obj, dict) and field in obj


# Every CEL rule in the vendored CRDs, as Python over `self` (the validated value).
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    "self == oldSelf": lambda s: True,  # transition rule: only evaluated on update
    "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']": (
        lambda s: s in ("ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue")
    ),
    "!(has(self.jobStatus) && has(self.jobDeploymentStatus))": (
        lambda s: not (_has(s, "jobStatus") and _has(s, "jobDeploymentStatus"))
    ),
    "has(self.jobStatus) || has(self.jobDeploymentStatus)": (
        lambda s: _has(s, "jobStatus") or _has(s, "jobDeploymentStatus")
    ),
    "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))": (
        lambda s: not ((_has(s, "onSuccess") or _has(s, "onFailure")) and _has(s, "deletionRules"))
    ),
    "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))": (
        lambda s: (_has(s, "onSuccess") and _has(s, "onFailure")) or _has(s, "deletionRules")
    ),
}

OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": DNS_1035_LABEL.pattern},
        "namespace": {"type": "string", "pattern": DNS_1035_LABEL.pattern},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}

FORMATS = FormatChecker(formats=())


@FORMATS.checks("int32")
def _int32(value: Any) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value: Any) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def _type(validator: Any, types: Any, instance: Any, schema: dict) -> Iterator[Any]:
    """OpenAPI's `nullable: true` lets null through whatever the type."""
    if instance is None and schema.get("nullable"):
        return
    yield from Draft4Validator.VALIDATORS["type"](validator, types, instance, schema)


def _list_type(validator: Any, kind: str, instance: Any, schema: dict) -> Iterator[Any]:
    """`map`: items unique by the list-map keys (after defaults); `set`: unique items."""
    if not isinstance(instance, list) or kind == "atomic":
        return
    if kind == "set":
        seen = [json.dumps(item, sort_keys=True) for item in instance]
        for index, key in enumerate(seen):
            if key in seen[:index]:
                yield jsonschema.ValidationError(f"duplicate item {instance[index]!r} in a set")
        return
    keys = schema.get("x-kubernetes-list-map-keys", [])
    properties = schema.get("items", {}).get("properties", {})
    seen_keys: list[tuple] = []
    for item in instance:
        if not isinstance(item, dict):
            continue
        key = tuple(item.get(k, properties.get(k, {}).get("default")) for k in keys)
        if key in seen_keys:
            yield jsonschema.ValidationError(
                f"duplicate item with {dict(zip(keys, key, strict=True))} in a list keyed by {keys}"
            )
        seen_keys.append(key)


def _cel(validator: Any, rules: list[dict], instance: Any, schema: dict) -> Iterator[Any]:
    """The CRD's CEL rules, through their Python translation; an unknown rule fails."""
    for rule in rules:
        check = CEL_RULES.get(rule["rule"])
        if check is None:
            yield jsonschema.ValidationError(
                f"CEL rule {rule['rule']!r} has no translation in CEL_RULES "
                "(cluster/crd_schema.py): add one instead of skipping it"
            )
        elif not check(instance):
            yield jsonschema.ValidationError(f"{rule.get('message', rule['rule'])}")


KubernetesValidator = validators.extend(
    Draft4Validator,
    {
        "type": _type,
        "x-kubernetes-list-type": _list_type,
        "x-kubernetes-validations": _cel,
    },
)


def _close_objects(node: Any) -> None:
    """Close every object schema that Kubernetes would prune unknown fields from (in place)."""
    if isinstance(node, dict):
        if (
            node.get("type") == "object"
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for key, value in node.items():
            if key == "properties":
                for child in value.values():
                    _close_objects(child)
            elif key not in ("enum", "default", "required", "x-kubernetes-validations"):
                _close_objects(value)
    elif isinstance(node, list):
        for child in node:
            _close_objects(child)


@functools.cache
def crd_schema(kind: str, version: str = "v1") -> dict:
    """The served `openAPIV3Schema` of `kind`, with Kubernetes' semantics made explicit."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 1 MB CRDs load 10x faster
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=loader)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    schema = served["schema"]["openAPIV3Schema"]  # freshly loaded: changed in place
    _close_objects(schema)
    schema["properties"]["metadata"] = OBJECT_META
    schema["properties"]["apiVersion"] = {"enum": [API_VERSION]}
    schema["properties"]["kind"] = {"enum": [kind]}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    del schema["properties"]["status"]  # written by the operator, never by a manifest
    return schema


@functools.cache
def _validator(kind: str) -> Any:
    return KubernetesValidator(crd_schema(kind), format_checker=FORMATS)


def schema_errors(doc: dict) -> list[str]:
    """Problems of one manifest against its CRD schema, each with its JSON path."""
    kind = doc.get("kind")
    if kind not in CRD_FILES:
        return [f"kind={kind!r}: not a KubeRay kind ({', '.join(CRD_FILES)})"]
    found = sorted(_validator(kind).iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{e.json_path}: {e.message}" for e in found]


def _groups(cluster: dict) -> list[tuple[str, dict]]:
    head = [("head", cluster.get("headGroupSpec", {}))]
    return head + [(g.get("groupName", "?"), g) for g in cluster.get("workerGroupSpecs", [])]


def _cluster_errors(cluster: dict, where: str) -> list[str]:
    """validation.go ValidateRayClusterSpec (a subset) and the replica bounds."""
    errors = []
    names = [g.get("groupName") for g in cluster.get("workerGroupSpecs", [])]
    if len(set(names)) != len(names):
        errors.append(f"{where}.workerGroupSpecs: group names repeat: {names}")
    for name, group in _groups(cluster):
        params = group.get("rayStartParams", {})
        if not group.get("template", {}).get("spec", {}).get("containers"):
            errors.append(f"{where} group {name}: the pod template has no container")
        if group.get("resources") and any(
            params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")
        ):
            errors.append(f"{where} group {name}: resources set in rayStartParams and resources")
        if "labels" in params:
            errors.append(f"{where} group {name}: rayStartParams.labels is refused; use labels")
        if name != "head":
            low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
            if not low <= group.get("replicas", low) <= high:
                errors.append(f"{where} group {name}: need minReplicas <= replicas <= maxReplicas")
    autoscaler = cluster.get("autoscalerOptions", {})
    if cluster.get("enableInTreeAutoscaling") and autoscaler.get("version") == "v2":
        for name, group in _groups(cluster):
            policy = group.get("template", {}).get("spec", {}).get("restartPolicy", "Never")
            if policy != "Never":
                errors.append(f"{where} group {name}: restartPolicy must be Never or unset (v2)")
    return errors


def kuberay_errors(doc: dict) -> list[str]:
    """The operator's admission checks that the schema cannot express (validation.go)."""
    kind, meta, spec = doc.get("kind"), doc.get("metadata", {}), doc.get("spec", {})
    errors = []
    name = meta.get("name", "")
    if len(name) > MAX_NAME_LENGTH.get(kind, 63):
        errors.append(f"metadata.name={name!r}: longer than {MAX_NAME_LENGTH[kind]} characters")
    if kind == "RayService":
        errors += _cluster_errors(spec.get("rayClusterConfig", {}), "spec.rayClusterConfig")
        try:
            serve = yaml.safe_load(spec.get("serveConfigV2", "") or "{}")
            if not isinstance(serve, dict):
                errors.append("spec.serveConfigV2: not a YAML mapping")
        except yaml.YAMLError as error:
            errors.append(f"spec.serveConfigV2: not YAML: {error}")
        upgrade = spec.get("upgradeStrategy", {}).get("type")
        if upgrade not in (None, "NewCluster", "NewClusterWithIncrementalUpgrade", "None"):
            errors.append(f"spec.upgradeStrategy.type={upgrade!r}: not a KubeRay strategy")
    if kind == "RayJob":
        if "rayClusterSpec" in spec:
            errors += _cluster_errors(spec["rayClusterSpec"], "spec.rayClusterSpec")
        elif not spec.get("clusterSelector"):
            errors.append("spec: one of rayClusterSpec or clusterSelector must be set")
        if spec.get("ttlSecondsAfterFinished", 0) > 0 and not spec.get("shutdownAfterJobFinishes"):
            errors.append("spec.ttlSecondsAfterFinished needs shutdownAfterJobFinishes: true")
        if spec.get("activeDeadlineSeconds", 1) <= 0:
            errors.append("spec.activeDeadlineSeconds must be > 0")
        if spec.get("submissionMode") == "InteractiveMode" and spec.get("backoffLimit", 0) > 0:
            errors.append("spec.backoffLimit is incompatible with InteractiveMode")
        try:
            yaml.safe_load(spec.get("runtimeEnvYAML", "") or "{}")
        except yaml.YAMLError as error:
            errors.append(f"spec.runtimeEnvYAML: not YAML: {error}")
    if kind == "RayCluster":
        errors += _cluster_errors(spec, "spec")
    return errors


def manifest_errors(doc: dict) -> list[str]:
    """Everything wrong with one manifest: its CRD schema, then the operator's checks."""
    return schema_errors(doc) + kuberay_errors(doc)


def main(paths: list[str]) -> int:
    """Check every document of every file; print the problems; exit status 1 if any."""
    bad = 0
    for path in paths:
        for index, doc in enumerate(yaml.safe_load_all(Path(path).read_text())):
            if not isinstance(doc, dict) or doc.get("apiVersion") != API_VERSION:
                continue
            errors = manifest_errors(doc)
            label = f"{path}#{index} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            print(f"{label}: {'ok' if not errors else f'{len(errors)} problem(s)'}")
            for error in errors:
                print(f"  {error}")
            bad += bool(errors)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
