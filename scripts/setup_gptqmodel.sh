#!/usr/bin/env bash
# Create a GPTQModel (CPU) virtual env, by default at .venvs/gptqmodel inside the repo: the second independent loader
# of compound's GPTQ/AWQ checkpoints (tests/integration/test_peer_loaders.py: GPTQModel's own loader and transformers'
# GPTQ/AWQ integration, which needs optimum) and the peer of benchmarks/decode.py.
#
#   bash scripts/setup_gptqmodel.sh [VENV]     # idempotent: does nothing when both import from the venv
#
# torch is installed first (venv_common.sh's torch_first), then gptqmodel and optimum. gptqmodel 7.7.0 needs
# torch>=2.14.1, so 7.6.0 is pinned; it is an sdist that is pure Python at install time (kernels are built at run time,
# and none is on CPU), built in the venv itself (--no-build-isolation), so no build env can resolve a torch of its own.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh"

venv_init gptqmodel GPTQModel "$@"
GPTQMODEL_VERSION="${GPTQMODEL_VERSION:-7.6.0}"
export BUILD_CUDA_EXT=0 GPTQMODEL_FORCE_BUILD=0 CUDA_VISIBLE_DEVICES=""

check() {
    torch_check <<'PY'
import gptqmodel, optimum  # noqa: F401  (optimum: transformers' GPTQ integration refuses to load without it)
print("gptqmodel", gptqmodel.__version__, "torch", torch.__version__)
PY
}

exit_if_ready
venv_create "$SETUPTOOLS"
torch_first -q
"$PY" -m pip install -q --no-build-isolation "gptqmodel==$GPTQMODEL_VERSION" optimum -c "$CONSTRAINTS"
check
