#!/usr/bin/env bash
# Create the llama.cpp virtual env, by default at .venvs/llamacpp inside the repo: llama.cpp itself (through
# llama-cpp-python, which compiles it from source) is the independent judge of compound's GGUF files
# (tests/integration/test_llamacpp.py) and the peer quantizer of benchmarks/llamacpp_gguf.py (llama_model_quantize).
#
#   bash scripts/setup_llamacpp.sh [VENV]           # idempotent: does nothing when llama_cpp imports from the venv
#   bash scripts/setup_llamacpp.sh --tools [VENV]   # also llama.cpp's llama-imatrix and llama-quantize in VENV/bin
#
# No torch in this venv: the judge script reads GGUF files and token ids only. The first build compiles llama.cpp
# (about 10-15 minutes on 2 cores); later calls return at once. GGML_NATIVE builds for this CPU's instruction set.
# --tools builds the two command-line tools of the benchmark's importance-matrix anchor from the same source:
# llama-cpp-python's sdist of the same version, which vendors llama.cpp (about 10 more minutes, once).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh"

TOOLS=0
if [[ "${1:-}" == "--tools" ]]; then TOOLS=1; shift; fi
venv_init llamacpp llama.cpp "$@"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
NATIVE_FLAGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF"
TOOL_NAMES=(llama-imatrix llama-quantize)
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

check() {
    "$PY" -P -c "import llama_cpp, numpy; print('llama_cpp', llama_cpp.__version__)"
}

tools_ready() {
    local tool
    for tool in "${TOOL_NAMES[@]}"; do [[ -x "$VENV/bin/$tool" ]] || return 1; done
}

# build_tools: the sdist's vendored llama.cpp, static, only the two tools; each copied into the venv's bin under a
# temporary name and renamed, so an interrupted build leaves no tool that looks finished
build_tools() {
    local work
    work="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT  # expanded now: the local is gone when the script exits
    "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$work"
    tar xzf "$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$work"
    # shellcheck disable=SC2086
    cmake -S "$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" -B "$work/build" \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TOOLS=ON $NATIVE_FLAGS > "$work/cmake.log"
    cmake --build "$work/build" --target "${TOOL_NAMES[@]}"
    local tool
    for tool in "${TOOL_NAMES[@]}"; do
        cp "$work/build/bin/$tool" "$VENV/bin/.$tool.partial"
        mv "$VENV/bin/.$tool.partial" "$VENV/bin/$tool"
    done
    echo "llama.cpp tools built: ${TOOL_NAMES[*]} in $VENV/bin"
}

if ! [[ -x "$PY" ]] || ! check 2>/dev/null; then
    venv_create
    export CMAKE_ARGS="${CMAKE_ARGS:-$NATIVE_FLAGS}"
    "$PY" -m pip install -q numpy "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    check
else
    echo "$LABEL venv already set up at $VENV"
fi
if (( TOOLS )) && ! tools_ready; then
    build_tools
fi
