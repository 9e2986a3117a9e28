#!/usr/bin/env bash
# Create one clean virtual env per peer quantization tool under benchmarks/.venvs/<peer>
# and install the peer there, with torch pinned to the CPU build 2.13.0.
#
#   bash benchmarks/peers/setup.sh                 # every peer (GPTQModel, llm-compressor, AutoRound)
#   bash benchmarks/peers/setup.sh gptqmodel       # one peer
#
# torch is installed FIRST (pip picks the local CPU wheel from /opt/wheels), then the peer
# with a constraint file pinning torch==2.13.0, so the resolver can never pull a CUDA build.
# Peer versions are pinned to the newest releases whose requirements accept torch 2.13:
#   gptqmodel 7.7.0 requires torch>=2.14.1  -> use 7.6.0 (torch>=2.8.0)
#   llmcompressor 0.14.0.1 requires torch<=2.14.0,>=2.10.0, transformers<=5.17.0
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENVS="$ROOT/benchmarks/.venvs"
PYTHON="${PYTHON:-python3}"
CONSTRAINTS="$HERE/constraints.txt"

GPTQMODEL_VERSION="${GPTQMODEL_VERSION:-7.6.0}"
LLMCOMPRESSOR_VERSION="${LLMCOMPRESSOR_VERSION:-0.14.0.1}"

# gptqmodel >= 7 is pure Python at install time (kernels are JIT-built at run time, only when a
# CUDA/CPU kernel is selected); these keep any older/other build path from compiling CUDA code.
export BUILD_CUDA_EXT=0
export GPTQMODEL_FORCE_BUILD=0
export CUDA_VISIBLE_DEVICES=""

make_venv() {
    local peer="$1"
    local venv="$VENVS/$peer"
    if [[ ! -x "$venv/bin/python" ]]; then
        mkdir -p "$VENVS"
        "$PYTHON" -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q --upgrade pip wheel "setuptools<83"
    "$venv/bin/python" -m pip install "torch==2.13.0" -c "$CONSTRAINTS"
}

check_torch() {
    local venv="$VENVS/$1"
    "$venv/bin/python" - <<'PY'
import torch, sys
v = torch.__version__
print("torch", v, "cuda:", torch.version.cuda)
if not v.startswith("2.13.0") or torch.version.cuda is not None:
    sys.exit("ERROR: wrong torch build in venv: %s (cuda=%s)" % (v, torch.version.cuda))
PY
}

install_gptqmodel() {
    # the same venv recipe as the tests' loader venv, made here under benchmarks/.venvs
    bash "$ROOT/scripts/setup_gptqmodel.sh" "$VENVS/gptqmodel"
}

install_autoround() {
    # scripts/setup_autoround.sh's venv, made here under benchmarks/.venvs (benchmarks/frontier.py's peer)
    bash "$ROOT/scripts/setup_autoround.sh" "$VENVS/autoround"
}

install_llmcompressor() {
    make_venv llmcompressor
    local py="$VENVS/llmcompressor/bin/python"
    "$py" -m pip install "llmcompressor==$LLMCOMPRESSOR_VERSION" -c "$CONSTRAINTS"
    check_torch llmcompressor
    "$py" -c "import llmcompressor, compressed_tensors; print('llmcompressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__)"
}

peers=("$@")
[[ ${#peers[@]} -eq 0 ]] && peers=(gptqmodel llmcompressor autoround)
for p in "${peers[@]}"; do
    case "$p" in
        gptqmodel) install_gptqmodel ;;
        autoround) install_autoround ;;
        llmcompressor) install_llmcompressor ;;
        *) echo "unknown peer: $p" >&2; exit 2 ;;
    esac
done
