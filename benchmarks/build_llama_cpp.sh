#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize and llama-bench (the interactive-1 and sizes peer) from the llama.cpp
# source that llama-cpp-python's sdist vendors: llama.cpp itself is not packaged for Debian bookworm,
# and PyPI is the one source this machine can reach.
#
#   benchmarks/build_llama_cpp.sh [DEST]        (DEST defaults to /work/llama.cpp-build)
#
# Then: tokenmill bench interactive --llama-server DEST/bin/llama-server
# (or TOKENMILL_LLAMA_SERVER=DEST/bin/llama-server). The sizes benchmark also uses the sdist's
# convert_hf_to_gguf.py and gguf-py (under DEST/src). On a shared machine run it under the heavy lock.
set -euo pipefail
DEST=${1:-/work/llama.cpp-build}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
SRC=$DEST/src
mkdir -p "$SRC"
if [ ! -d "$SRC/llama_cpp_python-$VERSION" ]; then
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
    tar -xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
fi
LLAMA=$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp
# GGML_NATIVE: tuned for this CPU (AVX-512/BF16/VNNI where present), as a local llama.cpp user builds it,
# but without AMX: on this VM (amx_tile/amx_int8 in /proc/cpuinfo) a native build segfaults in
# ggml_backend_amx_mul_mat (llama-bench's backtrace; llama-server dies the same way, on the default
# model and the 1B Q4_K_M alike). -mno-amx-* leaves __AMX_INT8__ undefined whatever its order beside
# -march=native, so that backend is not compiled, while the CPU repack of quantized weights stays
# (`--repack 0` also avoids the crash, but switches the repack off too).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The web UI is neither built nor fetched (no network for it; the benchmark uses the HTTP API only).
cmake -S "$LLAMA" -B "$DEST/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
cmake --build "$DEST/build" -j "$JOBS" --target llama-server llama-quantize llama-bench
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-server" "$DEST/build/bin/llama-quantize" "$DEST/build/bin/llama-bench" "$DEST/bin/"
# The sizes benchmark runs the sdist's convert_hf_to_gguf.py with tokenmill's python and the sdist's
# gguf-py; the one module the converter needs that tokenmill's venv lacks goes beside it, never into
# tokenmill's environment (bench/sizes_files.py puts it on the converter's PYTHONPATH only).
[ -d "$DEST/convert-deps/sentencepiece" ] || "$PY" -m pip install --target "$DEST/convert-deps" sentencepiece
"$DEST/bin/llama-server" --version
