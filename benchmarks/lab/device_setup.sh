#!/usr/bin/env bash
# Source this first in a lent-GPU call: installs, from the wheels carried in .whl/ and .whlx/ (see
# docs/cuda.md), only the packages the device image lacks, into /tmp/site (kept while the machine
# stays warm), and joins the default model's GGUF from halves carried in .gguf1/ and .gguf2/ into
# /tmp/real/m.gguf. Prints what it installed. A carried .llamacpp/llama_cpp (llama-cpp-python's package,
# its lib/ files copied without symlinks: ~9 MB) goes on PYTHONPATH, for llama.cpp's quantizer.
#   source benchmarks/lab/device_setup.sh
SITE=/tmp/site
mkdir -p "$SITE" /tmp/real
has() { python3 -c "import $1" 2>/dev/null; }
wheel() { ls .whl/"$1"-[0-9]*.whl .whlx/"$1"-[0-9]*.whl 2>/dev/null | head -1; }
installed=""
add() {   # add MODULE WHEEL-NAME...: the wheels when MODULE does not import (from the image or /tmp/site)
  local module=$1; shift
  has "$module" && return
  local files=""
  for w in "$@"; do f=$(wheel "$w"); [ -n "$f" ] && files="$files $f"; done
  [ -z "$files" ] && { echo "device_setup: $module missing and no wheel carried"; return; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $files \
    && installed="$installed $*"
}
export PYTHONPATH=.:$SITE PYTHONUNBUFFERED=1
for leaf in yaml:pyyaml tqdm:tqdm idna:idna certifi:certifi urllib3:urllib3 charset_normalizer:charset_normalizer \
            requests:requests typing_extensions:typing_extensions sniffio:sniffio h11:h11 execnet:execnet \
            ml_dtypes:ml_dtypes google.protobuf:protobuf prometheus_client:prometheus_client click:click; do
  add "${leaf%%:*}" "${leaf#*:}"
done
add gguf gguf
add tokenizers tokenizers
add onnx onnx
add xdist pytest_xdist
add anyio anyio
add httpx httpx httpcore
add pydantic pydantic pydantic_core annotated_types typing_inspection
add opentelemetry opentelemetry_api importlib_metadata zipp
add fastapi fastapi starlette annotated_doc
add uvicorn uvicorn
if [ -d .llamacpp/llama_cpp ]; then   # llama-cpp-python's package copied from here (its quantizer, issue 39's table)
  add diskcache diskcache
  export PYTHONPATH=$PYTHONPATH:$PWD/.llamacpp
fi
echo "device_setup: installed${installed:- nothing}"
if [ -f .gguf1/a ]; then cp .gguf1/a /tmp/real/a; fi
if [ -f .gguf2/b ] && [ -f /tmp/real/a ]; then cat /tmp/real/a .gguf2/b > /tmp/real/m.gguf && echo "device_setup: /tmp/real/m.gguf $(stat -c %s /tmp/real/m.gguf) bytes"; fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
