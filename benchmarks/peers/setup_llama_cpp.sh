#!/usr/bin/env bash
# Install llama.cpp as /work/shared/peers.md says, in benchmarks/.peers/ (git-ignored):
#
#   benchmarks/.peers/llama-cpp/          virtualenv: llama-cpp-python[server] 0.3.36 built from
#                                         source (GGML_NATIVE), gguf-py and the converter's deps
#   benchmarks/.peers/llama-cpp/src/      the llama-cpp-python source package, whose vendor/llama.cpp
#                                         holds convert_hf_to_gguf.py and gguf-py
#   benchmarks/.peers/llama-cpp/build/bin llama-server (continuous batching, -np N), llama-bench,
#                                         llama-batched-bench, built with CMake from that source
#
#   bash benchmarks/peers/setup_llama_cpp.sh
#
# About 5 minutes for the pip build plus a few for the CMake targets on 2 cores.
# run_peers.py converts checkpoints to GGUF on first use (benchmarks/.peers/gguf/).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEER="${LLAMA_CPP_DIR:-$ROOT/benchmarks/.peers/llama-cpp}"
PYTHON="${PYTHON:-python3}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"

mkdir -p "$PEER"
if [ ! -x "$PEER/bin/python" ]; then
  "$PYTHON" -m venv "$PEER"
fi

# 1. The Python package and its OpenAI-compatible server (one request at a time; pass
#    --n_threads N --n_threads_batch N and --interrupt_requests False when using it).
CMAKE_ARGS="-DGGML_NATIVE=ON" "$PEER/bin/pip" install "llama-cpp-python[server]==$VERSION"

# 2. The same source, for the converter and the C++ tools.
mkdir -p "$PEER/src"
find_src() { find "$PEER/src" -maxdepth 1 -type d -iname "llama[-_]cpp[-_]python-$VERSION" -print -quit; }
if [ -z "$(find_src)" ]; then
  "$PEER/bin/pip" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEER/src"
  tar -xzf "$(find "$PEER/src" -maxdepth 1 -iname "llama[-_]cpp[-_]python-$VERSION.tar.gz" -print -quit)" -C "$PEER/src"
fi
LLAMA_SRC="$(find_src)/vendor/llama.cpp"
test -f "$LLAMA_SRC/convert_hf_to_gguf.py"

# 3. Converter dependencies (torch from this machine's disk; never the project's .venv).
"$PEER/bin/pip" install "torch==2.13.0" transformers safetensors sentencepiece numpy "$LLAMA_SRC/gguf-py"

# 4. llama-server / llama-bench / llama-batched-bench. LLAMA_USE_PREBUILT_UI=OFF, otherwise
#    the build tries to download its web UI; LLAMA_CURL=OFF: nothing is fetched at run time.
#    LLAMA_CPP_AMX=0 (the default) builds without ggml's AMX kernels even where -march=native
#    has them: on the Sapphire Rapids VMs here its Q8_0 / Q4_0 matmul dies of SIGILL
#    (`tilezero` in tinygemm_kernel_amx) or SIGSEGV; its AVX-512 VNNI kernels run instead.
NO_AMX=""
if [ "${LLAMA_CPP_AMX:-0}" = "0" ]; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
cmake -S "$LLAMA_SRC" -B "$PEER/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
cmake --build "$PEER/build" -j "$JOBS" --target llama-server llama-bench llama-batched-bench llama-quantize

echo "$LLAMA_SRC" > "$PEER/SOURCE_DIR"
"$PEER/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
ls -l "$PEER/build/bin/llama-server" "$PEER/build/bin/llama-bench"
echo "llama.cpp ready in $PEER"
