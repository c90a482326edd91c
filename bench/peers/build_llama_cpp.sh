#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (the serving peer) and convert SmolLM2 to GGUF bf16.
#
# Sources come from the llama-cpp-python sdist on PyPI (its vendor/llama.cpp), the only way to
# get llama.cpp here without network beyond the package registries. Everything goes to a cache
# outside the repo; unit tests never call this. Takes ~6 minutes on 2 cores the first time.
#
#   bash bench/peers/build_llama_cpp.sh PYTHON [HF_DIR OUT_GGUF [OUTTYPE]]
#
# prints the llama-server path; with HF_DIR, also converts that checkpoint to GGUF at OUT_GGUF
# (OUTTYPE bf16, the default, or q8_0) using the sdist's own convert_hf_to_gguf.py and gguf-py
# (sentencepiece, which the converter imports, goes to the cache too, not into the caller's
# environment).
set -euo pipefail

PY=${1:-python3}
HF_DIR=${2:-}
OUT_GGUF=${3:-}
OUTTYPE=${4:-bf16}
VERSION=0.3.36
CACHE=${KVGATE_PEER_CACHE:-$HOME/.cache/kvgate/peers}
SRC=$CACHE/llama-cpp-python-$VERSION
# The peer is built for this CPU's own vector set, as a user of llama.cpp would build it:
# AVX2 + FMA always, and AVX-512 (with VBMI, VNNI and BF16 where the CPU has them) on a CPU
# with AVX-512. Never AMX: the native build picks Sapphire Rapids' AMX path and crashes there.
# Flags are read from /proc/cpuinfo rather than GGML_NATIVE, so the build dir can key on them.
# KVGATE_PEER_ISA=avx2 builds the AVX2 set on any CPU (the peer of a forced KVGATE_CPU_ISA=avx2).
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo || true)
[[ ${KVGATE_PEER_ISA:-} == avx2 ]] && FLAGS=""
GGML_ISA=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
ISA_TAG=avx2
if [[ " $FLAGS " == *" avx512f "* && " $FLAGS " == *" avx512bw "* && " $FLAGS " == *" avx512vl "* ]]; then
  GGML_ISA+=(-DGGML_AVX512=ON)
  ISA_TAG=avx512
  for ext in vbmi:VBMI avx512_vnni:VNNI avx512_bf16:BF16; do
    flag=${ext%%:*}; [[ $flag == vbmi ]] && flag=avx512vbmi
    if [[ " $FLAGS " == *" $flag "* ]]; then
      GGML_ISA+=("-DGGML_AVX512_${ext##*:}=ON")
      ISA_TAG+="-${ext##*:}"
    fi
  done
fi
BUILD=$CACHE/llama.cpp-build-$ISA_TAG
SERVER=$BUILD/bin/llama-server
mkdir -p "$CACHE"

if [ ! -d "$SRC" ]; then
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
  tar -xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
  mv "$CACHE/llama_cpp_python-$VERSION" "$SRC"
fi

if [ ! -x "$SERVER" ]; then
  cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF "${GGML_ISA[@]}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$CACHE/cmake.log" 2>&1
  cmake --build "$BUILD" --target llama-server -j "$(nproc)" >"$CACHE/build.log" 2>&1
fi

if [ -n "$HF_DIR" ] && [ ! -s "$OUT_GGUF" ]; then
  "$PY" -m pip install --quiet --target "$CACHE/convert-deps" sentencepiece >/dev/null 2>&1
  PYTHONPATH="$CACHE/convert-deps:$SRC/vendor/llama.cpp/gguf-py" "$PY" \
    "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$HF_DIR" --outtype "$OUTTYPE" \
    --outfile "$OUT_GGUF.tmp" >"$CACHE/convert.log" 2>&1
  mv "$OUT_GGUF.tmp" "$OUT_GGUF"
fi
echo "$SERVER"
