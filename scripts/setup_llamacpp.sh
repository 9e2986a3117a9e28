#!/usr/bin/env bash
# Create the llama.cpp virtual env, by default at .venvs/llamacpp inside the repo: llama.cpp itself (through
# llama-cpp-python, which compiles it from source) is the independent judge of compound's GGUF files
# (tests/integration/test_llamacpp.py) and the peer quantizer of benchmarks/llamacpp_gguf.py (llama_model_quantize).
#
#   bash scripts/setup_llamacpp.sh [VENV]     # idempotent: does nothing when llama_cpp imports from the venv
#
# No torch in this venv: the judge script reads GGUF files and token ids only. The first build compiles llama.cpp
# (about 10-15 minutes on 2 cores); later calls return at once. GGML_NATIVE builds for this CPU's instruction set.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh"

venv_init llamacpp llama.cpp "$@"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

check() {
    "$PY" -P -c "import llama_cpp, numpy; print('llama_cpp', llama_cpp.__version__)"
}

exit_if_ready
venv_create
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF}"
"$PY" -m pip install -q numpy "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
check
