#!/usr/bin/env bash
# Install keel (core + every in-repo plugin) into a virtual environment, editable.
#   bash scripts/install.sh            -> ./.venv
#   VENV=/some/where bash scripts/install.sh
# On a machine without an NVIDIA driver, torch is pinned to the CPU build first, so the resolver never
# pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip 'setuptools>=68' wheel
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q torch
  else
    pip install -q torch==2.13.0
  fi
fi
args=(-e ".[test]")
for p in plugins/*/; do
  [ -f "$p/pyproject.toml" ] && args+=(-e "$p")
done
pip install -q --no-build-isolation "${args[@]}"
echo "keel installed in $VENV: $("$VENV/bin/keel" --version 2>/dev/null || echo '?')"
