#!/usr/bin/env bash
# One device call: install keel (no network), run the CUDA tests, then the H200 benchmarks.
#   OUT=<dir> KEEL_COMMIT=<sha> bash benchmarks/h200_run.sh [moe-tiles] [moe-small-m] [tests] [llama] [dsv2-profile] [dsv2] [spec]
# Logs and results land in $OUT (each part has its own time limit so one slow part cannot eat the rest).
set -u
OUT=${OUT:-/tmp/keel-h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
parts=${*:-tests llama dsv2-profile}
python3 -m pip install -q --no-deps --no-build-isolation -e . $(ls -d plugins/*/ | sed 's/^/-e /') \
    >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
CUDA_TESTS="tests/test_cuda_platform.py tests/test_cuda_engine.py tests/test_cuda_custom_ops.py tests/test_cuda_mla.py
 tests/test_cuda_deepseek_preemption.py tests/test_cuda_spec_graphs.py tests/test_cuda_runner_cpu_parts.py
 tests/test_sampler_cuda.py tests/test_async_scheduling.py plugins/attention_flash/tests plugins/kernels_triton/tests
 plugins/models_deepseek/tests/test_fused_moe.py plugins/attention_torch/tests/test_attention_torch_conformance.py"
for part in $parts; do
  start=$(date +%s)
  case $part in
    # SIGINT, not timeout's SIGTERM: pytest stops like on Ctrl-C and still prints the summary (failures,
    # counts, the test it was in); -k kills it if even that hangs.
    tests) timeout -s INT -k 30 400 python3 -m pytest -p no:cacheprovider -rfE $CUDA_TESTS >"$OUT/tests.log" 2>&1
           tail -4 "$OUT/tests.log";;
    moe-tiles) timeout 170 python3 benchmarks/h200_moe_tiles.py --out "$OUT" >"$OUT/moe-tiles.log" 2>&1
           tail -16 "$OUT/moe-tiles.log";;
    moe-small-m) timeout 300 python3 benchmarks/h200_moe_small_m.py --out "$OUT/h200-moe-small-m.json" \
             >"$OUT/moe-small-m.log" 2>&1; tail -32 "$OUT/moe-small-m.log";;
    llama) timeout 480 python3 benchmarks/h200_llama8b.py --out "$OUT/h200-llama8b.json" >"$OUT/llama.log" 2>&1
           tail -12 "$OUT/llama.log";;
    dsv2-profile) cp benchmarks/results/h200-dsv2lite.json "$OUT/" 2>/dev/null
           timeout 150 python3 benchmarks/h200_dsv2lite.py --profile-only --out "$OUT/h200-dsv2lite.json" \
             >"$OUT/dsv2.log" 2>&1; tail -5 "$OUT/dsv2.log";;
    dsv2) timeout 480 python3 benchmarks/h200_dsv2lite.py --out "$OUT/h200-dsv2lite.json" >"$OUT/dsv2.log" 2>&1
          tail -12 "$OUT/dsv2.log";;
    spec) timeout 450 python3 benchmarks/h200_spec.py --out "$OUT/h200-spec.json" >"$OUT/spec.log" 2>&1
          tail -8 "$OUT/spec.log";;
    *) echo "unknown part $part";;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
done
