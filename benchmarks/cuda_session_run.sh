#!/usr/bin/env bash
# One lent-GPU call for a session's changes: the audio log-mel against torch.stft, the cuda tests, the
# GEMV variants, decode attention at 32k and prefill at 4k, SmolLM2 end to end by default, with the
# norm folded into the GEMVs (INGOT_CUDA_NORM_GEMV=1) and without the decode short path, and
# Llama-3-8B end to end both ways; compact lines on stdout, JSON under $OUT.
#   bash benchmarks/cuda_session_run.sh
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ingot-cuda}; mkdir -p "$OUT"
# issue 5's goal in one run: the hour's log-mel against torch.stft alone
timeout "${AUDIO_S:-200}" python3 benchmarks/audio.py --device cuda --quick --skip-parts --durations 3600 \
  --also "lanes 16,lanes 8" 2>&1 | grep " ms\|ratio torch.stft"
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -n 16 tests/test_cuda.py tests/test_cuda_gemv_xq.py \
  tests/test_cuda_batch.py tests/test_cuda_bf16.py tests/test_cuda_sampling.py tests/test_cuda_norm_gemv.py \
  tests/test_cuda_decode_attention.py tests/test_cuda_prefill.py --maxfail=30 -rf 2>&1 | grep -v "^\.*\s*\[\|^$" | tail -15
timeout "${GEMV_S:-100}" python3 benchmarks/cuda_kernels.py --only gemv --rows 1,4 \
  --shapes smollm_qkv,llama8b_gate+up,llama8b_down,llama8b_lm_head --row-shapes llama8b_gate+up \
  --variants "${GEMV_VARIANTS:-default,limbs3,limbs1,xq-l1,xq-l2,xq-l3,xfree,xq-l2-rows4}" --json "$OUT/gemv.json" 2>&1 | grep "^qgemv\|^   " | tail -12
timeout "${ATTN_S:-150}" python3 benchmarks/cuda_kernels.py --only decode,prefill --quick --json "$OUT/attention.json" 2>&1 \
  | grep "^decode attention\|^prefill attention"
smollm() { tag=$1; shift; env "$@" timeout "${SMOLLM_S:-60}" python3 benchmarks/cuda_llm.py --models smollm2 --steps 128 \
  --json "$OUT/smollm_$tag.json" 2>&1 | grep "tok/s" | sed "s/^/[$tag] /"; }
smollm default
smollm norm-gemv INGOT_CUDA_NORM_GEMV=1
smollm short-off INGOT_CUDA_DECODE_SHORT=0
llama() { tag=$1; shift; env "$@" timeout "${LLAMA_S:-150}" python3 benchmarks/cuda_llm.py --models llama8b --llama-layers 32 \
  --steps 64 --json "$OUT/llama_$tag.json" 2>&1 | grep "tok/s" | sed "s/^/[$tag] /"; }
llama default
llama norm-gemv INGOT_CUDA_NORM_GEMV=1
