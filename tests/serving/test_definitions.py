"""deployments/definitions.py names each replica's class by import path, which only a replica
imports: a path that no longer names its class would fail when a server's replicas start, so
each is resolved here, and both layouts build without importing the replicas' code."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from ray.serve import Deployment

from deployments import definitions

REPO = Path(__file__).parents[2]
DEPLOYMENTS = [value for value in vars(definitions).values() if isinstance(value, Deployment)]


def test_every_deployment_is_defined_by_path() -> None:
    names = sorted(d.name for d in DEPLOYMENTS)
    assert names == ["Draft", "Ingress", "Pair", "Router", "SessionRegistry", "Verifier"]
    assert all(isinstance(d.func_or_class, str) for d in DEPLOYMENTS)


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=lambda d: d.name)
def test_each_path_names_a_class_of_the_deployments_name(deployment: Deployment) -> None:
    module, name = deployment.func_or_class.rsplit(".", 1)
    found = getattr(importlib.import_module(module), name)
    assert inspect.isclass(found) and found.__name__ == deployment.name


@pytest.mark.slow
def test_both_layouts_build_without_the_replicas_code() -> None:
    code = (
        "import sys; from deployments.app import build_app; "
        "[build_app({'layout': layout}) for layout in ('split', 'colocated')]; "
        "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", f"building an application imported {out.stdout.strip()}"
