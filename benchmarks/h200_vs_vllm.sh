#!/usr/bin/env bash
# Device calls for the keel-vs-vLLM comparison (benchmarks/h200_vs_vllm.py). Parts, in order given:
#   install        keel and its plugins (no network) into the device's python3: benchmarks/fast_install.py (a .pth
#                  and dist-infos, ~1 s) unless INSTALL=pip (editable pip installs, ~50 s)
#   vllm-cNN       unpack vLLM chunk NN ($VLLM_CHUNKS/cNN, carried; default .vllm-peer/chunks), one call per
#                  chunk, back to back (the machine must stay warm); VLLM_LAST_CHUNK=cNN (default c02) names the last,
#                  whose part also reassembles vLLM into /tmp/vsite. A call carries 64 MiB with the working
#                  tree (~7 MiB now), so the kit's default 60 MiB chunks no longer fit: split it into 50 MiB
#                  ones (the kit's split.sh with CHUNK=50M: c01-c03; VLLM_CHUNKS=<dir> VLLM_LAST_CHUNK=c03)
#   vllm-extra     wheels vLLM imports for quantized models, not in the kit (compressed-tensors, loguru: fetch them
#                  here with `pip download --no-deps compressed-tensors loguru -d .vllm-peer/extra`), into its site
#   ckpt           write the seeded random DSV2-Lite checkpoint both engines load (/tmp/dsv2ckpt)
#   ckpt-gptq      write a seeded Llama-8B-shape checkpoint in GPTQ's 4-bit g128 layout (/tmp/llamagptq; random
#                  codes, write_checkpoint): both engines load the same bytes and run their GPTQ kernels
#                  (vLLM: Marlin) -- on dummy weights vLLM ran its bf16 model
#   keel-gptq-ckpt vllm-gptq-ckpt               one engine on that checkpoint
#   ckpt-gptq-act keel-gptq-act-ckpt vllm-gptq-act-ckpt   the same with desc_act (act order: shuffled groups;
#                  /tmp/llamagptqact)
#   ckpt-dsv2-fp8  write the seeded DSV2-Lite checkpoint in DeepSeek-V3's block-fp8 layout (/tmp/dsv2fp8; keel's
#                  quantizer, layer 0's MLP bf16 and in ignored_layers), so both engines route alike (~16 GB)
#   keel-dsv2-fp8-ckpt vllm-dsv2-fp8-ckpt       one engine on that checkpoint
#   ref-dsv2-fp8-ckpt  transformers on that checkpoint's weights, dequantized (bf16 copy in /tmp, run in float32
#                  where it fits): the reference top-2 rows both engines' `top2` are read against (~3 min)
#   keel-llama keel-dsv2 vllm-llama vllm-dsv2    one engine, one model (dsv2: from the checkpoint)
#   keel-llama-Q vllm-llama-Q                   Llama-8B with dummy weights quantized as Q: fp8-tensor, fp8-block, gptq
#   keel-dsv2-Q vllm-dsv2-Q                     DSV2-Lite the same way (each engine draws its own weights: routing differs)
#   diag-llama(-Q) diag-dsv2                    keel with --diagnose (what runs lazily per round)
#   OUT=<dir> KEEL_COMMIT=<sha> bash benchmarks/h200_vs_vllm.sh install keel-llama ...
set -u
OUT=${OUT:-/tmp/keel-h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# MAX_NUM_SEQS: both engines' (default issue 11's); KV_CACHE_DTYPE: both engines' (auto, fp8)
B="python3 benchmarks/h200_vs_vllm.py --max-num-seqs ${MAX_NUM_SEQS:-256} --kv-cache-dtype ${KV_CACHE_DTYPE:-auto}"
VSITE=/tmp/vsite
CKPT=/tmp/dsv2ckpt
GPTQ_CKPT=/tmp/llamagptq
GPTQ_ACT_CKPT=/tmp/llamagptqact
DSV2_FP8_CKPT=/tmp/dsv2fp8
for part in "$@"; do
  start=$(date +%s)
  case $part in
    install) n=$(ls plugins/*/pyproject.toml | wc -l)
             [ "${INSTALL:-fast}" = pip ] || { python3 benchmarks/fast_install.py 2>&1 | tail -2
               # discovery must see keel and every plugin, or the editable pip install runs after all
               python3 -c "import importlib.metadata as md, keel, keel_kernels_triton
assert len({e.name for e in md.entry_points(group='keel.plugins')}) >= $n + 1" || INSTALL=pip; }
             if [ "${INSTALL:-fast}" = pip ]; then
               python3 -m pip install -q --no-deps --no-build-isolation -e . $(ls -d plugins/*/ | sed 's/^/-e /') \
                 >"$OUT/install.log" 2>&1 || tail -20 "$OUT/install.log"
             fi
             python3 -c 'import torch, triton; print("gpus", torch.cuda.device_count(), torch.__version__, triton.__version__)'
             # every engine start loads the xgrammar plugin: without its wheels (part wheels, .whl carried) each
             # engine run and CUDA test fails at startup, minutes later
             python3 -c 'import xgrammar' 2>/dev/null || echo "WARNING: xgrammar does not import: carry .whl" \
               "(benchmarks/device_wheels.sh) and run part wheels first, or every engine start fails";;
    vllm-c0*)
      c=${part#vllm-}; mkdir -p /tmp/vin && cp -r ${VLLM_CHUNKS:-.vllm-peer/chunks}/$c /tmp/vin/
      if [ "$c" = "${VLLM_LAST_CHUNK:-c02}" ]; then
        SMOKE=0 bash /tmp/vin/c01/reassemble.sh /tmp/vin $VSITE 2>&1 | tail -3
      else bash /tmp/vin/c01/reassemble.sh --status /tmp/vin 2>&1 | tail -3; fi;;
    vllm-extra) python3 -m pip install -q --no-index --no-deps --target $VSITE .vllm-peer/extra/*.whl 2>&1 | tail -2;;
    ckpt) [ -f $CKPT/model.safetensors.index.json ] || timeout 240 python3 -c "
import sys, json, time; sys.path.insert(0, 'benchmarks'); import h200_vs_vllm as m; from pathlib import Path
t = time.perf_counter(); m.write_checkpoint(Path('$CKPT'), 'dsv2lite'); print('checkpoint written', round(time.perf_counter() - t, 1), 's')";;
    ckpt-gptq|ckpt-gptq-act) q=${part#ckpt-}; d=$([ $q = gptq ] && echo $GPTQ_CKPT || echo $GPTQ_ACT_CKPT)
      [ -f $d/model.safetensors.index.json ] || timeout 300 python3 -c "
import sys, time; sys.path.insert(0, 'benchmarks'); import h200_vs_vllm as m; from pathlib import Path
t = time.perf_counter(); m.write_checkpoint(Path('$d'), 'llama8b', quantization='$q')
print('$q checkpoint written', round(time.perf_counter() - t, 1), 's')";;
    ckpt-dsv2-fp8) [ -f $DSV2_FP8_CKPT/model.safetensors.index.json ] || timeout 400 python3 -c "
import sys, time; sys.path.insert(0, 'benchmarks'); import h200_vs_vllm as m; from pathlib import Path
t = time.perf_counter(); m.write_checkpoint(Path('$DSV2_FP8_CKPT'), 'dsv2lite', quantization='fp8-block')
print('dsv2lite fp8-block checkpoint written', round(time.perf_counter() - t, 1), 's')";;
    keel-dsv2-fp8-ckpt|vllm-dsv2-fp8-ckpt)  # before keel-dsv2-*: the checkpoint, not dummy weights
      timeout 480 $B --arch dsv2lite --engines ${part%%-*} --model-dir $DSV2_FP8_CKPT --vllm-site $VSITE \
        --timeout 460 --out "$OUT/$part.json" 2>&1 | tail -c 1500;;
    ref-dsv2-fp8-ckpt) timeout 420 $B --arch dsv2lite --engines hf --model-dir $DSV2_FP8_CKPT --timeout 400 \
        --out "$OUT/$part.json" 2>&1 | tail -c 1500;;
    keel-gptq-ckpt|vllm-gptq-ckpt|keel-gptq-act-ckpt|vllm-gptq-act-ckpt)
      d=$(case $part in *-act-*) echo $GPTQ_ACT_CKPT;; *) echo $GPTQ_CKPT;; esac)
      timeout 420 $B --arch llama8b --engines ${part%%-*} --model-dir $d --vllm-site $VSITE \
        --out "$OUT/$part.json" 2>&1 | tail -c 1500;;
    keel-llama|vllm-llama|diag-llama|keel-llama-*|vllm-llama-*|diag-llama-*)
      e=${part%%-*}; [ $e = diag ] && e="keel --diagnose"
      q=${part#*-llama}; q=${q#-}  # keel-llama-fp8-tensor: dummy weights in that layout (fp8-tensor, fp8-block, gptq)
      timeout 420 $B --arch llama8b --engines $e --vllm-site $VSITE $([ -n "$q" ] && echo --quantization $q) \
        --out "$OUT/$part.json" 2>&1 | tail -c 1500;;
    keel-dsv2-*|vllm-dsv2-*)
      e=${part%%-*}; q=${part#*-dsv2-}
      timeout 480 $B --arch dsv2lite --engines $e --vllm-site $VSITE --quantization $q --timeout 460 \
        --out "$OUT/$part.json" 2>&1 | tail -c 1500;;
    keel-dsv2|vllm-dsv2|diag-dsv2)
      e=${part%%-*}; [ $e = diag ] && e="keel --diagnose"
      timeout 420 $B --arch dsv2lite --engines $e --model-dir $CKPT --vllm-site $VSITE --out "$OUT/$part.json" 2>&1 | tail -c 1500;;
    diagdummy-dsv2) timeout 300 $B --arch dsv2lite --engines keel --diagnose --out "$OUT/$part.json" 2>&1 | tail -c 600;;
    *) echo "unknown part $part";;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
done
