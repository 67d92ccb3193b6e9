#!/usr/bin/env bash
# One device call of H200 measurements, in the order given, each part under its own time limit:
#   OUT=<dir> KEEL_COMMIT=<sha, spelled out here: not $(git ...) on the device> bash benchmarks/h200_run.sh wheels install ckpt keel-dsv2 keel-llama \
#       profile-dsv2 profile-llama spec bitmask quant tests
# The device returns only a few files, so every result goes to $OUT/w and leaves as one $OUT/h200-run.tgz
# (h200-run-2.tgz, ... for later invocations into the same OUT)
# (untar it, then commit the figures you rely on to benchmarks/results/); each part prints its key lines.
#   wheels    the xgrammar wheels carried in .whl/ (the device has no network) into /tmp/site; fetch them here
#             first with benchmarks/device_wheels.sh (xgrammar alone fails there: it needs pydantic too)
#   install   keel and every plugin, editable, no dependencies
#   ckpt keel-dsv2 keel-llama vllm-* ref-*   see benchmarks/h200_vs_vllm.sh (vLLM needs one call per chunk)
#   bitmask   h200_bitmask.py with the BPE vocabulary (BPE_FILE, default dev/bpe128k.json: train one with
#             h200_bitmask.bpe_tokenizer_info, or leave it absent and the part trains it, ~1-2 min), then
#             bitmask_gil.py (the fill thread's GIL cost to a busy loop, host only, ~20 s; with the backend's
#             fill threads and with 4)
#   gc        gc_per_step.py: objects left in reference cycles per decode step, collections per 100 steps
#             (batch 256, plain and constrained, with and without bitmask_timeline's wrappers)
#   block-gemm h200_block_fp8_gemm.py: block fp8 GEMMs (cuBLAS block-scaled, Triton) vs bf16 at M 256-8192
#   profile-plans  h200_step_profile.py, Llama-8B GPTQ int4 g128 and fp8 per-tensor (dummy) at batch 1 with the shipped
#             decode GEMM plans, then with those of a small-m part run before it in the same call
#   profile-gptq, profile-fp8  h200_step_profile.py on Llama-8B with dummy GPTQ int4 / fp8 per-tensor weights
#             (profile-gptq-nopdl, profile-fp8-nopdl: with the quantization kernels' PDL off, --no-pdl-quant)
#   int4-prefill h200_int4_prefill.py: prefill-sized int4 GEMMs (Triton tiles, dequantize + cuBLAS, bf16 cuBLAS)
#   profile-pdl profile-nopdl  h200_step_profile.py, Llama-8B and DSV2-Lite (dummy) at batch 1 / 256, PDL on / off
#   int4-wdeq h200_int4_wdeq.py: an int4 GEMM that scales the weight tile, not the partial product (WDEQ_MS)
#   int4-mma  h200_int4_mma.py: the swapped-operand int4 tensor-core GEMM's tiles against the tile GEMM, dequantize +
#             cuBLAS and bf16 cuBLAS at M 8-512 (MMA_MS, MMA_BUDGET_S); the device's plan file in $W/int4-mma/
#   swept-gptq-ckpt swept-gptq-act-ckpt  keel-gptq(-act)-ckpt with the plans of an int4-mma part run before it in the
#             same call (KEEL_INT4_MMA_CONFIG_DIR; results in $W/swept/): shipped plans vs the sweep's in one call
#   fp8-mid-m h200_fp8_mid_m.py: Llama-8B's fp8 per-row GEMMs at M 64-512, torch._scaled_mm (shipped) against the
#             Triton W8A8 GEMM's tiles and K splits (FP8_MID_MS, FP8_MID_BUDGET_S): is cuBLAS's one-tile choice leaving
#             SMs idle on the 4096-wide layers
#   int4-dequant h200_int4_dequant.py: the full int4 dequantize, old kernel, shipped tile and a tile sweep
#   act-quant h200_fp8_act_quant.py: fp8 activation quantization per launch variant at Llama-8B's inputs
#   fp8-fusion h200_fp8_input_fusion.py: the quantization fused into RMSNorm / SiluAndMul against the unfused pair,
#             the fused SiluAndMul per launch variant (FUSION_ARGS=--groups: block fp8's kernels too)
#   fast-accum h200_fp8_fast_accum.py: torch._scaled_mm row-wise at Llama-8B's shapes, M 1024 / 8192, with and without
#             use_fast_accum (time and error; vLLM's sm_90 W8A8 kernel accumulates fast), ~20 s
#   kv-write  h200_kv_write.py: one layer's KV cache write (Llama-8B 8 x 128, DeepSeek's 576 latent) at 1 / 256 /
#             8192 tokens: fp8 quantized in torch then copied, fp8 quantized in the write kernel, bf16
#   fp8-words  h200_decode_attention.py --fp8 --fp8-words: triton_flash / triton_mla decode over an fp8 cache read as
#              bytes and as int32 words (decode_fp8_words; flash's also inline, decode_words_ahead off), every
#              launch and split count (WORDS_SHAPES, WORDS_ONLY; FLASH_LAUNCHES: triton_flash's launches instead,
#              e.g. 32x2x3,64x2x3)
#   fp8-attn-ab  one call's decision on the fp8 decode attention: the fp8-words sweep at 1024 x 192 (FLASH_LAUNCHES,
#             a trailing b: block numbers loaded a tile ahead; WORDS_SHAPES), its fastest one-split launch over bytes
#             and inline words (h200_decode_attention.py --best-fp8), then keel-llama-fp8-tensor as shipped
#             ($W/ab-shipped.json) and with that launch ($W/ab-picked.json: impl.py's _BATCH_LAUNCH_FP8_MANY,
#             _BLOCKS_AHEAD and _FP8_WORDS set by sed, restored after); with MAX_NUM_SEQS=1024 KV_CACHE_DTYPE=fp8
#   ncu-attn  Nsight Compute on triton_flash's decode attention at the 1024-request shape (ncu_decode_attention.py:
#             fp8 bytes at the engine's launch and 32-token tiles, fp8 words, bf16; NCU_SHAPE, default 1024x192):
#             occupancy, issue, stall reasons, DRAM; CSV in $W/ncu-decode-attention.csv (~60 s)
#   ncu-small-m  Nsight Compute on int4 gemv_fold at M = 1 (ncu_small_m.py: Llama-8B's four layers, shipped plans, then
#             NCU_FOLD_PLANS, e.g. 1x8x1024,1x16x1024s2): duration, DRAM, occupancy and the stall reasons per issued
#             instruction (ncu_stalls.py); raw CSV in $W/ncu-small-m.csv, rows in $W/ncu-small-m.json (~60-90 s)
#   flash-attn  h200_decode_attention.py --only flash over a bf16 cache (FLASH_SHAPES, default 1024x192,64x1024):
#             the bf16 decode beside fp8-words' figures (bf16 read at ~94% of copy bandwidth on the H100)
#   mla-attn-ab  h200_decode_attention.py --only mla, bf16 then fp8 (bytes and words): the shipped decode loop against
#             block numbers loaded a tile ahead (MLA_LAUNCHES, heads x tile x warps x stages, a trailing b; MLA_SHAPES,
#             default 256x192,256x640,64x1024,1x2048), into $W/h200-decode-mla-{bf16,fp8}.json (~4-6 min)
#   small-m   h200_quant_small_m.py: decode-size GEMM plans per family (SMALLM_FAMILIES; SMALLM_BUDGET_S, default 150;
#             SMALLM_MS: only these M, e.g. 1,2; SMALLM_SHAPES=dsv2lite: DeepSeek-V2-Lite's dense projections)
#   quant     h200_quant.py's engine cases (QUANT_CASES; QUANT_INT4_MIN_M: int4's dequantize + cuBLAS threshold;
#             QUANT_TAG: a suffix for its files, to run it twice in a call); QUANT_PLANS=$W/h200-quant-small-m.json: with the plans
#             of a small-m part run before it in the same call, over the shipped tables
#   moe-w2    h200_moe_decode_sweep.py --focus w2: the fused MoE's down GEMM at decode sizes, silu in its A load or
#             as its own kernel (MOE_BUDGET_S, default 75); config files and results under $W/moe-w2
#   profile-tiles  h200_step_profile.py, DSV2-Lite (dummy) decode at batch 1 / 256 with the shipped MoE tiles, then
#             with the H200 files under this device's name (KEEL_MOE_TILE_CONFIG_DIR): this device's tiles vs the
#             H200's, in one call
#   profile-qkv-a  h200_step_profile.py, DSV2-Lite (dummy) decode at batch 1 / 256 with MLA's fused_qkv_a_proj and
#             without (--no-fuse-qkv-a), in one call
#   linear-small-m  h200_linear_small_m.py: the unquantized small-M GEMV against cuBLAS per decode projection
#             shape (LINEAR_BUDGET_S, default 120); plans it wins written to $W/linear-small-m/<device>.json
#   profile-linear  h200_step_profile.py, Llama-8B and DSV2-Lite (dummy) decode at batch 1 / 8, with the plans of
#             a linear-small-m part run before it in the same call (KEEL_LINEAR_SMALL_M_CONFIG_DIR) and without
#   profile-ab  h200_step_profile.py (AB_ARCH, default dsv2lite; AB_BATCH, default 1,256; AB_ARGS, more of its
#             arguments, e.g. --quantization-case llama8b-gptq; dummy weights) on the
#             working tree ("after"), then with the files under AB_DIR (default ab/: the same relative paths, e.g.
#             `bash benchmarks/ab_folder.sh ab <base> <commit>`: each file the commit touched, as at base; untracked
#             files travel) copied
#             over ("before"), then the tree restored: a change's effect on the step in one call
#   profile-abs several profile-ab runs in one call: AB_SETS, one "dir|arch|batches|arguments" a line (sets with the
#             same arch, batches and arguments share one "after" run; AB_SHARE_AFTER=0: one each), e.g.
#             AB_SETS=$'ab-splitk|llama8b|1,256|--quantization-case llama8b-fp8-tensor\nab-dsv2|dsv2lite||--quantization-case dsv2lite-fp8-block'
#   moe-prefill  h200_moe_prefill.py: DSV2-Lite's MoE GEMMs at prefill sizes (MOE_PREFILL_TOKENS, default 1024-8192)
#             against dense cuBLAS, silu in the down GEMM's A load / as its own kernel / as the w13 GEMM's epilogue,
#             and the pair through torch._grouped_mm (pair_ms per size);
#             the shipped tile files with the epilogue pair's tiles where it won, into $W/moe-prefill-configs
#   moe-prefill-ab  (after moe-prefill) DSV2-Lite's step profile with the shipped tiles, then with those: the
#             8192-token prefill step and the batch-256 step, before the new entries replace the shipped ones
#   host-dsv2 host-llama  h200_step_profile.py --host-prefill (dummy weights, batch 1): the prefill step's CPU vs wall
#             time, each engine.step's wall in it and a cProfile top list (DSV2-Lite's prefill wall ran ~35 ms past
#             its GPU time on the H200 at d646db6, Llama-8B's ~0; the MLA tile tables' torch CPU ops, numpy since 3adf255)
#   router    h200_router_gemm.py: the router logits, reference (copy + cuBLAS float32) vs the split-weight kernel
#   mla-attn  h200_decode_attention.py: MLA's decode kernel per launch and split count (MLA_SHAPES, batch x context,
#             default 256x192,256x640,64x192,1x192), then its prefill tiles per launch (MLA_PREFILL, prompts x length,
#             default 64x128 16x512; time limits MLA_DECODE_S, MLA_PREFILL_S); $W/mla-decode-attention.json, $W/mla-prefill-attention.json
#   tests     the CUDA tests (TESTS, default: the attention and kernel plugins' tests, then every tests/test_cuda_*.py)
set -u
OUT=${OUT:-/tmp/keel-h200}
W=$OUT/w
mkdir -p "$W"
export PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
T0=$(date +%s)
# The device's checkout may carry a stale .git: the caller names the commit (KEEL_COMMIT), and the benchmarks
# record it (keel.bench.source_commit).
[ -n "${KEEL_COMMIT:-}" ] && export KEEL_COMMIT && echo "$KEEL_COMMIT" >"$W/commit.txt"
# The kernels' own tests first (each against its reference, on fresh inputs): at 3b4321d a 300 s run of the old
# order (engine tests first) reached 8% of the list, and the first GPU run of the attention plugin's tests then
# found two failures the interpreter never showed (an FMA contraction, CUDA's canonical NaN).
# The quantization plugin's engine tests last: they ran on a GPU first at 9a71d88, where a 16 x 16 block-fp8 layout
# stopped at warm-up (fixed at 4c8d325) -- a launch variant no CUDA test had built.
TESTS=${TESTS:-"plugins/attention_flash/tests plugins/kernels_triton/tests plugins/models_deepseek/tests/test_fused_moe.py
 $(ls tests/test_cuda_*.py)
 plugins/structured_output_xgrammar/tests/test_structured_outputs.py::test_cuda_async_engine_with_the_fused_mask
 plugins/quantization/tests/test_fp8_engine.py"}
# Every keel engine start loads the xgrammar plugin: without its wheels (part wheels, .whl carried) such a part would
# fail at startup after its checkpoint and warm-up work; it is skipped at once instead, saying why.
xgrammar_ok=""
# profile_ab DIR ARCH BATCHES ARGS TAG [AFTER]: the step profile on the tree ("after"; AFTER: an earlier run's
# result of the same tree and arguments, reused), then with DIR's files copied over ("before"), then the tree
# restored (a file new in "after" stays); results step-profile-ab<TAG>-{after,before}.json
profile_ab() {
  local ab=$1 bak=/tmp/ab-backup t
  rm -rf $bak; mkdir -p $bak
  [ -d "$ab" ] || { echo "profile-ab: no $ab folder"; return; }
  for t in after before; do
    if [ $t = after ] && [ -n "${6:-}" ] && [ -f "$6" ]; then
      cp "$6" "$W/step-profile-ab$5-after.json"
      echo "$ab $2 after (that of $(basename "$6")): $(grep -E '"(batch|step_wall_ms_median)"' "$6" | tr -d ' \n')"
      continue
    fi
    if [ $t = before ]; then
      (cd "$ab" && find . -type f) | while read -r f; do
        mkdir -p "$bak/$(dirname "$f")"; cp "$f" "$bak/$f" 2>/dev/null; cp "$ab/$f" "$f"; done
    fi
    # shellcheck disable=SC2086  # ARGS are several arguments
    timeout 110 python3 benchmarks/h200_step_profile.py --arch "$2" --batch "$3" --mixed "" $4 \
      --out "$W/step-profile-ab$5-$t.json" >"$W/ab$5-$t.log" 2>&1
    echo "$ab $2 $t: $(grep -E '"(batch|step_wall_ms_median)"' "$W/step-profile-ab$5-$t.json" | tr -d ' \n')"
  done
  (cd "$ab" && find . -type f) | while read -r f; do
    if [ -f "$bak/$f" ]; then cp "$bak/$f" "$f"; fi; done
}
# Nsight Compute's binary (empty where the device has none): the ncu-* parts
ncu_path() { command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1; }
for part in "$@"; do
  start=$(date +%s)
  case $part in keel-*|diag*|swept-*|profile-*|host-*|quant|spec|bitmask|gc|moe-prefill-ab|fp8-attn-ab)
    [ -n "$xgrammar_ok" ] || { python3 -c 'import xgrammar' 2>/dev/null && xgrammar_ok=1; }
    [ -n "$xgrammar_ok" ] || { echo "== $part: skipped: xgrammar does not import (carry .whl, run part wheels first)"
                               continue; };;
  esac
  case $part in
    wheels) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
              .whl/*.whl && export PYTHONPATH=/tmp/site;;
    install|ckpt|ckpt-*|keel-*|vllm-*|diag-*|ref-*) OUT=$W bash benchmarks/h200_vs_vllm.sh "$part";;
    swept-gptq-ckpt|swept-gptq-act-ckpt)  # keel on the GPTQ checkpoint with this call's int4-mma sweep's plans
      mkdir -p "$W/swept"; KEEL_INT4_MMA_CONFIG_DIR=$W/int4-mma OUT=$W/swept bash benchmarks/h200_vs_vllm.sh "keel-${part#swept-}";;
    profile-dsv2) timeout 100 python3 benchmarks/h200_step_profile.py --arch dsv2lite --model-dir /tmp/dsv2ckpt \
                    --batch 1,256 --mixed 256 --out "$W/h200-step-profile-dsv2lite.json" >"$W/profile-dsv2.log" 2>&1
                  tail -c 800 "$W/profile-dsv2.log";;
    profile-llama) timeout 100 python3 benchmarks/h200_step_profile.py --arch llama8b --batch 1,256 \
                     --out "$W/h200-step-profile-llama8b.json" >"$W/profile-llama.log" 2>&1
                   tail -c 800 "$W/profile-llama.log";;
    profile-pdl|profile-nopdl)  # Llama-8B and DSV2-Lite (dummy weights) decode at batch 1 / 256, with or without PDL
      f=$([ "$part" = profile-nopdl ] && echo --no-pdl)
      for arch in llama8b dsv2lite; do
        timeout 110 python3 benchmarks/h200_step_profile.py --arch $arch --batch 1,256 --mixed "" $f \
          --out "$W/h200-step-profile-$arch-${part#profile-}.json" >"$W/$part-$arch.log" 2>&1
        grep -E '"(batch|step_wall_ms_median|gpu_ms_per_step|num_kernels)"' "$W/h200-step-profile-$arch-${part#profile-}.json" | tr -d ' \n'; echo
      done;;
    profile-gptq|profile-fp8|profile-gptq-nopdl|profile-fp8-nopdl)  # Llama-8B shape with dummy weights in h200_quant.py's
      # GPTQ int4 g128 / fp8 per-tensor layout; -nopdl: the quantization kernels without programmatic dependent launch
      q=llama8b-gptq; b=1
      case $part in profile-fp8*) q=llama8b-fp8-tensor; b=1,256;; esac
      f=$(case $part in *-nopdl) echo --no-pdl-quant;; esac)
      timeout 100 python3 benchmarks/h200_step_profile.py --arch llama8b --batch $b --mixed "" $f \
        --quantization-case $q --out "$W/h200-step-profile-llama8b-${part#profile-}.json" >"$W/$part.log" 2>&1
      tail -c 800 "$W/$part.log";;
    profile-plans)  # Llama-8B GPTQ / fp8 (dummy) decode with the shipped plans, then a small-m part's (run before it)
      for q in llama8b-gptq llama8b-fp8-tensor; do
        for t in shipped swept; do
          timeout 100 python3 benchmarks/h200_step_profile.py --arch llama8b --batch 1 --mixed "" --quantization-case $q \
            $([ $t = swept ] && echo --plans "$W/h200-quant-small-m.json") --out "$W/step-profile-$q-plans-$t.json" \
            >"$W/plans-$q-$t.log" 2>&1
          echo "$q $t: $(grep -E '"(step_wall_ms_median|gpu_ms_per_step|num_kernels)"' "$W/step-profile-$q-plans-$t.json" | tr -d ' \n')"
        done
      done;;
    spec) timeout 120 python3 benchmarks/h200_spec.py --engines plain,mtp_k3 --out "$W/h200-spec.json" \
            >"$W/spec.log" 2>&1; grep -E "^(plain|mtp)" "$W/spec.log" | cut -c1-600;;
    bitmask) timeout 150 python3 benchmarks/h200_bitmask.py --vocab-file "${BPE_FILE:-dev/bpe128k.json}" \
               --fill-threads-also "${FILL_THREADS_ALSO:-4}" --out "$W/h200-bitmask.json" >"$W/bitmask.log" 2>&1
             grep -v '^ \|^{\|^}' "$W/bitmask.log" | tail -5
             for t in default 4; do  # xgrammar's fill threads: the backend's count, and 4
               timeout 60 python3 benchmarks/bitmask_gil.py --vocab-file "${BPE_FILE:-dev/bpe128k.json}" \
                 $([ $t = default ] || echo --fill-threads $t) --out "$W/h200-bitmask-gil-$t.json" \
                 >"$W/bitmask-gil-$t.log" 2>&1; head -1 "$W/bitmask-gil-$t.log"
             done;;
    gc) timeout 150 python3 benchmarks/gc_per_step.py --out "$W/h200-gc-per-step.json" >"$W/gc.log" 2>&1
        grep -E '^(plain|constrained)' "$W/gc.log" | cut -c1-600;;
    quant) timeout 300 python3 benchmarks/h200_quant.py --cases ${QUANT_CASES:-llama8b-fp8-tensor llama8b-fp8-block \
             dsv2lite-fp8-block llama8b-gptq} $([ -n "${QUANT_PLANS:-}" ] && echo --plans "$QUANT_PLANS") \
             $([ -n "${QUANT_INT4_MIN_M:-}" ] && echo --int4-dequant-min-m "$QUANT_INT4_MIN_M") \
             --out "$W/h200-quant${QUANT_TAG:-}.json" >"$W/quant${QUANT_TAG:-}.log" 2>&1
           grep -E "^\S+ (\{\"output_tok_s|lazy work round 1)" "$W/quant${QUANT_TAG:-}.log" | cut -c1-700;;
    int4-wdeq) timeout 240 python3 benchmarks/h200_int4_wdeq.py --ms "${WDEQ_MS:-64,128,256,512,1024,2048,8192}" \
                 --out "$W/h200-int4-wdeq.json" >"$W/int4-wdeq.log" 2>&1; tail -n 9 "$W/int4-wdeq.log" | cut -c1-600;;
    int4-dequant) timeout 120 python3 benchmarks/h200_int4_dequant.py --out "$W/h200-int4-dequant.json" \
                    >"$W/int4-dequant.log" 2>&1; tail -n 8 "$W/int4-dequant.log" | cut -c1-1500;;
    int4-prefill) timeout 240 python3 benchmarks/h200_int4_prefill.py --budget-s "${INT4_BUDGET_S:-150}" \
                    --ms "${INT4_MS:-16,32,64,128,256,512,1024,8192}" --out "$W/h200-int4-prefill.json" \
                    >"$W/int4-prefill.log" 2>&1; tail -n 40 "$W/int4-prefill.log" | cut -c1-400;;
    int4-mma) timeout $(( ${MMA_BUDGET_S:-120} + 60 )) python3 benchmarks/h200_int4_mma.py --ms "${MMA_MS:-8,16,32,64,128,256,512}" \
                --budget-s "${MMA_BUDGET_S:-120}" --out "$W/h200-int4-mma.json" >"$W/int4-mma.log" 2>&1
              tail -n 45 "$W/int4-mma.log" | cut -c1-300;;
    fp8-mid-m) timeout $(( ${FP8_MID_BUDGET_S:-90} + 60 )) python3 benchmarks/h200_fp8_mid_m.py \
                --ms "${FP8_MID_MS:-64,128,256,512}" --budget-s "${FP8_MID_BUDGET_S:-90}" --out "$W/h200-fp8-mid-m.json" \
                >"$W/fp8-mid-m.log" 2>&1; tail -n 30 "$W/fp8-mid-m.log" | cut -c1-300;;
    fp8-fusion) timeout 150 python3 benchmarks/h200_fp8_input_fusion.py ${FUSION_ARGS:-} --out "$W/h200-fp8-input-fusion.json" \
                  >"$W/fp8-fusion.log" 2>&1; cut -c1-400 "$W/fp8-fusion.log" | tail -16;;
    act-quant) timeout 90 python3 benchmarks/h200_fp8_act_quant.py --out "$W/h200-fp8-act-quant.json" \
                 >"$W/act-quant.log" 2>&1; tail -n 20 "$W/act-quant.log" | cut -c1-400;;
    fast-accum) timeout 90 python3 benchmarks/h200_fp8_fast_accum.py --out "$W/h200-fp8-fast-accum.json" \
                  >"$W/fast-accum.log" 2>&1; tail -n 10 "$W/fast-accum.log" | cut -c1-300;;
    kv-write) timeout 90 python3 benchmarks/h200_kv_write.py --out "$W/h200-kv-write.json" \
                >"$W/kv-write.log" 2>&1; tail -n 20 "$W/kv-write.log" | cut -c1-400;;
    fp8-words) timeout 200 python3 benchmarks/h200_decode_attention.py --fp8 --fp8-words ${WORDS_ONLY:+--only $WORDS_ONLY} \
                 ${FLASH_LAUNCHES:+--flash-launches $FLASH_LAUNCHES} \
                 --shapes "${WORDS_SHAPES:-1024x192,256x192,64x1024,1x2048}" --out "$W/h200-decode-fp8-words.json" \
                 >"$W/fp8-words.log" 2>&1; tail -n 10 "$W/fp8-words.log" | cut -c1-400;;
    fp8-attn-ab)  # sweep, pick, then the harness as shipped and with the picked launch
      timeout 240 python3 benchmarks/h200_decode_attention.py --fp8 --fp8-words --only flash \
        --flash-launches "${FLASH_LAUNCHES:-64x2x3b,32x2x3b,64x4x3b,32x4x3b,64x4x2,32x2x2}" \
        --shapes "${WORDS_SHAPES:-1024x192}" --out "$W/h200-decode-fp8-words.json" >"$W/fp8-words.log" 2>&1
      tail -n 3 "$W/fp8-words.log" | cut -c1-400
      sel=$(python3 benchmarks/h200_decode_attention.py --best-fp8 "$W/h200-decode-fp8-words.json")
      echo "picked: $sel"  # "bytes|inline TILE, WARPS, STAGES BLOCKS_AHEAD"
      f=plugins/attention_flash/keel_attention_flash/impl.py; cp $f /tmp/impl-ab.py
      OUT=$W bash benchmarks/h200_vs_vllm.sh keel-llama-fp8-tensor
      mv "$W/keel-llama-fp8-tensor.json" "$W/ab-shipped.json"
      if [ -n "$sel" ]; then
        mode=${sel%% *} rest=${sel#* }; ahead=${rest##* } launch=${rest% *}
        # the pick both ways (the shipped constants are on since e560c05; a False pick turns them off); 1024
        # requests are past _WORDS_INLINE_MIN_PROGRAMS, so words there are inline
        sed -i -e "s/^_BATCH_LAUNCH_FP8_MANY = .*/_BATCH_LAUNCH_FP8_MANY = ($launch)/" \
          -e "s/^_BLOCKS_AHEAD = .*/_BLOCKS_AHEAD = $([ "$ahead" = 1 ] && echo True || echo False)/" \
          -e "s/^_FP8_WORDS = .*/_FP8_WORDS = $([ "$mode" = inline ] && echo True || echo False)/" $f
        grep -E "^(_FP8_WORDS|_WORDS_INLINE_MIN_PROGRAMS|_BATCH_LAUNCH_FP8_MANY|_BLOCKS_AHEAD)" $f \
          | tee "$W/ab-picked-settings.txt"
        OUT=$W bash benchmarks/h200_vs_vllm.sh keel-llama-fp8-tensor
        mv "$W/keel-llama-fp8-tensor.json" "$W/ab-picked.json"
      fi
      cp /tmp/impl-ab.py $f;;
    ncu-attn) n=$(ncu_path)
              if [ -z "$n" ]; then echo "ncu-attn: no ncu on this machine"; else
                timeout 150 "$n" --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
                  --section SchedulerStats --section MemoryWorkloadAnalysis -k regex:split_decode --csv --page details \
                  python3 benchmarks/ncu_decode_attention.py --shape "${NCU_SHAPE:-1024x192}" \
                  >"$W/ncu-decode-attention.csv" 2>"$W/ncu-attn.log"
                grep "^case" "$W/ncu-decode-attention.csv"; tail -n 3 "$W/ncu-attn.log"; fi;;
    ncu-small-m) n=$(ncu_path)
              if [ -z "$n" ]; then echo "ncu-small-m: no ncu on this machine"; else
                timeout 240 "$n" --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
                  --section MemoryWorkloadAnalysis --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
                  -k regex:gemv_fold --csv --page raw python3 benchmarks/ncu_small_m.py --fold-plans "${NCU_FOLD_PLANS:-}" \
                  >"$W/ncu-small-m.csv" 2>"$W/ncu-small-m.log"
                python3 benchmarks/ncu_stalls.py "$W/ncu-small-m.csv" --out "$W/ncu-small-m.json"; tail -n 3 "$W/ncu-small-m.log"; fi;;
    flash-attn) timeout 120 python3 benchmarks/h200_decode_attention.py --only flash \
                  --shapes "${FLASH_SHAPES:-1024x192,64x1024}" --out "$W/h200-decode-bf16.json" >"$W/flash-attn.log" 2>&1
                tail -n 4 "$W/flash-attn.log" | cut -c1-300;;
    mla-attn-ab)  # triton_mla's decode, the shipped loop against block numbers a tile ahead, bf16 then fp8
      for c in bf16 fp8; do
        timeout 170 python3 benchmarks/h200_decode_attention.py --only mla $([ $c = fp8 ] && echo --fp8 --fp8-words) \
          --mla-launches "${MLA_LAUNCHES:-16x32x4x2,16x32x4x3b,16x64x4x3b,16x32x4x4b,16x16x4x3b}" \
          --shapes "${MLA_SHAPES:-256x192,256x640,64x1024,1x2048}" --out "$W/h200-decode-mla-$c.json" \
          >"$W/mla-attn-ab-$c.log" 2>&1
        tail -n 4 "$W/mla-attn-ab-$c.log" | cut -c1-400
      done;;
    small-m) timeout $(( ${SMALLM_BUDGET_S:-150} + 90 )) python3 benchmarks/h200_quant_small_m.py \
               --families ${SMALLM_FAMILIES:-fp8_row fp8_block int4_g128} --budget-s "${SMALLM_BUDGET_S:-150}" \
               $([ -n "${SMALLM_MS:-}" ] && echo --ms "$SMALLM_MS") --shapes "${SMALLM_SHAPES:-llama8b}" \
               --out "$W/h200-quant-small-m.json" >"$W/small-m.log" 2>&1; tail -n 30 "$W/small-m.log" | cut -c1-400;;
    moe-w2) timeout $(( ${MOE_BUDGET_S:-75} + 90 )) python3 benchmarks/h200_moe_decode_sweep.py --focus w2 \
              --budget-s "${MOE_BUDGET_S:-75}" --out "$W/moe-w2" >"$W/moe-w2.log" 2>&1
            grep -E "^(M=|  drop|NVIDIA)" "$W/moe-w2.log" | cut -c1-420;;
    profile-tiles)
      dev=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))'); mkdir -p /tmp/h200tiles
      for f in plugins/kernels_triton/keel_kernels_triton/fused_moe/configs/*NVIDIA_H200.json; do
        b=$(basename "$f"); cp "$f" "/tmp/h200tiles/${b%NVIDIA_H200.json}$dev.json"; done
      for t in shipped h200; do
        KEEL_MOE_TILE_CONFIG_DIR=$([ $t = h200 ] && echo /tmp/h200tiles) timeout 110 python3 benchmarks/h200_step_profile.py \
          --arch dsv2lite --batch 1,256 --mixed "" --out "$W/step-profile-dsv2lite-tiles-$t.json" >"$W/tiles-$t.log" 2>&1
        echo "$t: $(grep -E '"(batch|step_wall_ms_median|gpu_ms_per_step)"' "$W/step-profile-dsv2lite-tiles-$t.json" | tr -d ' \n')"
      done;;
    profile-qkv-a)
      for t in fused separate; do
        timeout 110 python3 benchmarks/h200_step_profile.py --arch dsv2lite --batch 1,256 --mixed "" \
          $([ $t = separate ] && echo --no-fuse-qkv-a) --out "$W/step-profile-dsv2lite-qkv-a-$t.json" >"$W/qkv-a-$t.log" 2>&1
        echo "$t: $(grep -E '"(batch|step_wall_ms_median|gpu_ms_per_step)"' "$W/step-profile-dsv2lite-qkv-a-$t.json" | tr -d ' \n')"
      done;;
    linear-small-m) timeout $(( ${LINEAR_BUDGET_S:-120} + 90 )) python3 benchmarks/h200_linear_small_m.py \
                      --out-dir "$W/linear-small-m" --budget-s "${LINEAR_BUDGET_S:-120}" >"$W/linear-small-m.log" 2>&1
                    grep -E "^(NVIDIA|llama|dsv2|plans)" "$W/linear-small-m.log" | cut -c1-400;;
    profile-linear)
      for arch in llama8b dsv2lite; do
        for t in gemv cublas; do
          KEEL_LINEAR_SMALL_M_CONFIG_DIR=$([ $t = gemv ] && echo "$W/linear-small-m") timeout 110 python3 \
            benchmarks/h200_step_profile.py --arch $arch --batch 1,8 --mixed "" \
            --out "$W/step-profile-$arch-linear-$t.json" >"$W/linear-$arch-$t.log" 2>&1
          echo "$arch $t: $(grep -E '"(batch|step_wall_ms_median)"' "$W/step-profile-$arch-linear-$t.json" | tr -d ' \n')"
        done
      done;;
    profile-ab) profile_ab "${AB_DIR:-ab}" "${AB_ARCH:-dsv2lite}" "${AB_BATCH:-1,256}" "${AB_ARGS:-}" "";;
    profile-abs)  # several A/Bs in one call: AB_SETS, one "dir|arch|batches|arguments" a line; the "after" run
      # (the tree as it is) is made once per arch, batches and arguments and shared by the sets that repeat them
      # (AB_SHARE_AFTER=0: one per set, e.g. to see the run-to-run spread)
      declare -A after_of=()
      while IFS='|' read -r d a b x; do
        [ -n "$d" ] || continue
        key="$a|${b:-1,256}|$x" tag="-$(basename "$d")-$a"
        profile_ab "$d" "$a" "${b:-1,256}" "$x" "$tag" "${after_of[$key]:-}"
        [ "${AB_SHARE_AFTER:-1}" = 0 ] || [ -n "${after_of[$key]:-}" ] || after_of[$key]="$W/step-profile-ab$tag-after.json"
      done <<<"${AB_SETS:-}";;
    mla-attn) timeout "${MLA_DECODE_S:-240}" python3 benchmarks/h200_decode_attention.py --only mla \
                --shapes "${MLA_SHAPES:-256x192,256x640,64x192,1x192}" --out "$W/mla-decode-attention.json" \
                >"$W/mla-decode-attention.log" 2>&1; grep '"best"' "$W/mla-decode-attention.log" | cut -c1-300
              # shellcheck disable=SC2086  # several prompts x length pairs
              timeout "${MLA_PREFILL_S:-150}" python3 benchmarks/h200_decode_attention.py --mla-prefill ${MLA_PREFILL:-64x128 16x512} \
                --out "$W/mla-prefill-attention.json" >"$W/mla-prefill-attention.log" 2>&1
              grep -E '"best"|"launch": null' "$W/mla-prefill-attention.log" | cut -c1-300;;
    moe-prefill) timeout 150 python3 benchmarks/h200_moe_prefill.py --out "$W/h200-moe-prefill.json" \
                   --tokens ${MOE_PREFILL_TOKENS:-1024 2048 4096 8192} \
                   --write-configs "$W/moe-prefill-configs" >"$W/moe-prefill.log" 2>&1
                 grep -o '"tokens": [0-9]*\|"pair_ms": {[^}]*}\|"configs_written": {[^}]*}' "$W/moe-prefill.log" | paste -sd' ';;
    moe-prefill-ab)  # after moe-prefill: the DSV2-Lite step profile (8192-token prefill step, batch-256 decode) with
      # the shipped tiles, then with the epilogue pair's where it won ($W/moe-prefill-configs searched first)
      for t in shipped epilogue; do
        KEEL_MOE_TILE_CONFIG_DIR=$([ $t = epilogue ] && echo "$W/moe-prefill-configs") timeout 110 python3 \
          benchmarks/h200_step_profile.py --arch dsv2lite --batch 256 --mixed "" \
          --out "$W/step-profile-dsv2lite-moe-prefill-$t.json" >"$W/moe-prefill-ab-$t.log" 2>&1
        echo "$t: $(python3 -c "import json; d = json.load(open('$W/step-profile-dsv2lite-moe-prefill-$t.json'))
print('prefill wall', d['prefill']['wall_ms_median'], 'gpu', round(d['prefill']['total_gpu_ms'], 2),
      'b256', d['decode'][0]['step_wall_ms_median'])" 2>&1 | tail -1)"
      done;;
    host-dsv2|host-llama) arch=$([ $part = host-dsv2 ] && echo dsv2lite || echo llama8b)
                  timeout 150 python3 benchmarks/h200_step_profile.py --arch $arch --batch 1 --mixed "" --host-prefill \
                    --out "$W/h200-step-profile-host-$arch.json" >"$W/$part.log" 2>&1; tail -c 600 "$W/$part.log";;
    router) timeout 90 python3 benchmarks/h200_router_gemm.py --out "$W/h200-router-gemm.json" >"$W/router.log" 2>&1
            tail -n 12 "$W/router.log" | cut -c1-300;;
    block-gemm) timeout 90 python3 benchmarks/h200_block_fp8_gemm.py --out "$W/h200-block-fp8-gemm.json" \
                  >"$W/block-gemm.log" 2>&1; tail -n 80 "$W/block-gemm.log";;
    # SIGINT, not timeout's SIGTERM: pytest stops as on Ctrl-C and still prints its summary.
    # --durations: where a cut-short run's time went (the log travels in the archive)
    tests) timeout -s INT -k 15 "${TESTS_S:-240}" python3 -m pytest -p no:cacheprovider -rfE --durations=40 $TESTS \
             >"$W/cuda-tests.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$W/cuda-tests.log" | tail -20;;
    *) echo "unknown part $part";;
  esac
  echo "== $part: $(( $(date +%s) - start )) s (call at $(( $(date +%s) - T0 )) s)"
done
# A second run into the same OUT (several invocations in one device call) keeps the first one's archive.
t="$OUT/h200-run.tgz" n=1
while [ -e "$t" ]; do n=$((n + 1)); t="$OUT/h200-run-$n.tgz"; done
tar -czf "$t" -C "$W" . && rm -rf "$W" && ls -la "$OUT"
