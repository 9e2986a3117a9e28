#!/usr/bin/env bash
# Create a GPTQModel (CPU) virtual env, by default at .venvs/gptqmodel inside the repo: the second independent loader
# of compound's GPTQ/AWQ checkpoints (tests/integration/test_peer_loaders.py: GPTQModel's own loader and transformers'
# GPTQ/AWQ integration, which needs optimum) and the peer of benchmarks/decode.py.
#
#   bash scripts/setup_gptqmodel.sh [VENV]     # idempotent: does nothing when both import from the venv
#
# torch is installed FIRST (the CPU wheel 2.13.0), then gptqmodel and optimum with a constraint file pinning
# torch==2.13.0, so the resolver can never pull a CUDA torch. gptqmodel 7.7.0 needs torch>=2.14.1, so 7.6.0 is pinned;
# it is an sdist that is pure Python at install time (kernels are built at run time, and none is on CPU), built in
# the venv itself (--no-build-isolation), so no build env can resolve a torch of its own.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venvs/gptqmodel}"
PYTHON="${PYTHON:-python3}"
GPTQMODEL_VERSION="${GPTQMODEL_VERSION:-7.6.0}"
PY="$VENV/bin/python"
export BUILD_CUDA_EXT=0 GPTQMODEL_FORCE_BUILD=0 CUDA_VISIBLE_DEVICES=""

check() {
    "$PY" -P - <<'PY'  # -P: the repo root (cwd) not on sys.path, where kernels/ would shadow the PyPI package
import sys
import torch
if not torch.__version__.startswith("2.13.0") or torch.version.cuda is not None:
    sys.exit(f"wrong torch build in the GPTQModel venv: {torch.__version__} (cuda={torch.version.cuda})")
import gptqmodel, optimum  # noqa: F401  (optimum: transformers' GPTQ integration refuses to load without it)
print("gptqmodel", gptqmodel.__version__, "torch", torch.__version__)
PY
}

if [[ -x "$PY" ]] && check 2>/dev/null; then
    echo "GPTQModel venv already set up at $VENV"
    exit 0
fi

[[ -x "$PY" ]] || { mkdir -p "$(dirname "$VENV")"; "$PYTHON" -m venv "$VENV"; }
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"

"$PY" -m pip install -q --upgrade pip wheel "setuptools>=77.0.1,<83"
"$PY" -m pip install -q "torch==2.13.0" -c "$CONSTRAINTS"
"$PY" -m pip install -q --no-build-isolation "gptqmodel==$GPTQMODEL_VERSION" optimum -c "$CONSTRAINTS"
check
