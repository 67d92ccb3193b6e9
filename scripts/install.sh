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
step() { echo "keel install [$1/4] $2"; }
step 1 "virtual environment $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
step 2 "pip, setuptools (>=77: SPDX license strings), wheel"
pip install -q --upgrade pip 'setuptools>=77' wheel
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  # the one large download: pip's progress bar stays on
  if command -v nvidia-smi >/dev/null 2>&1; then
    step 3 "torch (CUDA build: an NVIDIA driver is present)"
    pip install --progress-bar on torch
  else
    step 3 "torch 2.13.0 (CPU build: no NVIDIA driver)"
    pip install --progress-bar on torch==2.13.0
  fi
else
  step 3 "torch: already installed ($("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
fi
args=(-e ".[test]")
for p in plugins/*/; do
  [ -f "$p/pyproject.toml" ] && args+=(-e "$p")
done
step 4 "keel and $(( ${#args[@]} / 2 - 1 )) plugins, editable, with their dependencies"
# setuptools prints one "Editable installation" note per editable package (the same paragraph 12 times);
# only that note is silenced: other build warnings still show.
PYTHONWARNINGS="ignore:Editable installation" pip install -q --no-build-isolation "${args[@]}"
echo "keel installed in $VENV: $("$VENV/bin/keel" --version 2>/dev/null || echo '?')"
