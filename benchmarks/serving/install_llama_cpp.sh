#!/usr/bin/env bash
# Build llama-cpp-python (CPU only) with its OpenAI server into a separate venv,
# the baseline of benchmarks/serving/compare_serving.py. It compiles llama.cpp from source:
# about 10-20 minutes on 2 cores. Nothing in splitserve imports it.
#
#   bash benchmarks/serving/install_llama_cpp.sh [VENV_DIR]     # default /work/llamacpp-venv
#
# The venv is kept apart from splitserve's so its pins (fastapi, pydantic, numpy)
# never touch ours. Re-running is cheap once the wheel is built (pip's cache).
set -euo pipefail
VENV="${1:-${LLAMA_CPP_VENV:-/work/llamacpp-venv}}"
VERSION="0.3.16"   # pinned: the server flags used by compare_serving.py are this version's
PYTHON="${PYTHON:-python3.11}"

command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip wheel >/dev/null
# CPU build: no BLAS, no GPU backends, no llava/mtmd library (not needed by the server
# for a text model, and it doubles the build time).
export CMAKE_ARGS="-DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
start=$(date +%s)
"$VENV/bin/pip" install --no-binary llama-cpp-python "llama-cpp-python[server]==${VERSION}"
echo "llama-cpp-python ${VERSION} installed in $VENV in $(( $(date +%s) - start )) s"
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server; print('llama_cpp', llama_cpp.__version__)"
