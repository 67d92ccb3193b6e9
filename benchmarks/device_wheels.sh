#!/usr/bin/env bash
# The wheels h200_run.sh's `wheels` part installs on the device (it has no network): xgrammar and what it
# needs beyond the device's own packages, for the device's Python (3.12, manylinux x86_64), at the versions
# of this checkout's .venv. Run here, then carry .whl/ (ignored by git) with the device call.
#   bash benchmarks/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
for p in xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection; do
  v=$("$PY" -m pip show "$p" | sed -n 's/^Version: //p')
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${DEVICE_PYTHON:-3.12}" \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d .whl "$p==$v"
done
ls .whl
