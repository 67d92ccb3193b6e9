#!/usr/bin/env bash
# One device call (< 5 min): the DeepSeek-V2-Lite step profile -- batch-256 decode, a mixed window
# (prompts filling the 8192-token budget beside the 256 decodes), an 8192-token prefill step -- of the
# tree unpacked in before/ and of this tree, so both sets of figures come from one device session.
#   git archive <commit to compare against> core plugins | (mkdir -p before && tar -x -C before)
#   OUT=<dir> KEEL_COMMIT=<sha of this tree> BEFORE_COMMIT=<sha> bash benchmarks/h200_before_after.sh
# before/ runs through PYTHONPATH ahead of the editable installs (the plugins' entry points import the
# before/ packages too); the benchmark scripts are this tree's. Results: $OUT/step-profile-{before,after}.json.
set -u
OUT=${OUT:-/tmp/keel-h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . $(ls -d plugins/*/ | sed 's/^/-e /') \
    >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
# The CUDA checks of this tree's changes first (compiled kernels, the pinned copy), briefly.
timeout -s INT -k 10 50 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_staging.py tests/test_cuda_mla.py \
  plugins/kernels_triton/tests/test_mla_rope.py >"$OUT/tests.log" 2>&1; tail -2 "$OUT/tests.log"
before_path="$PWD/before/core:$(ls -d "$PWD"/before/plugins/*/ | tr '\n' ':')"
for side in before after; do
  start=$(date +%s)
  if [ "$side" = before ]; then
    [ -d before/core ] || { echo "no before/ tree: skipping it"; continue; }
    env PYTHONPATH="$before_path" KEEL_COMMIT="${BEFORE_COMMIT:-before}" timeout 110 python3 \
      benchmarks/h200_step_profile.py --arch dsv2lite --batch 256 --out "$OUT/step-profile-before.json" \
      >"$OUT/step-profile-before.log" 2>&1
  else
    KEEL_COMMIT="${KEEL_COMMIT:-after}" timeout 110 python3 benchmarks/h200_step_profile.py --arch dsv2lite \
      --batch 256 --out "$OUT/step-profile-after.json" >"$OUT/step-profile-after.log" 2>&1
  fi
  tail -3 "$OUT/step-profile-$side.log"
  echo "== $side: $(( $(date +%s) - start )) s"
done
