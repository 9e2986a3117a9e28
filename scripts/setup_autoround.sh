#!/usr/bin/env bash
# Create an AutoRound (CPU) virtual env, by default at benchmarks/.venvs/autoround inside the repo: the learned-rounding
# peer of benchmarks/frontier.py (Intel's SignRound, PyPI auto-round), run there by benchmarks/peers/run_autoround.py.
#
#   bash scripts/setup_autoround.sh [VENV]     # idempotent: does nothing when auto_round already imports from the venv
#
# torch is installed first (venv_common.sh's torch_first), then auto-round without its "cpu" extra (auto-round-lib,
# numba, tbb: packing kernels for its own export formats, which the benchmark does not use; it reads the dequantized
# weights back instead).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh"

venv_init autoround AutoRound "${1:-$ROOT/benchmarks/.venvs/autoround}"
AUTOROUND_VERSION="${AUTOROUND_VERSION:-0.16.0}"
export CUDA_VISIBLE_DEVICES=""

check() {
    torch_check <<'PY'
import auto_round
print("auto-round", auto_round.__version__, "torch", torch.__version__)
PY
}

exit_if_ready
venv_create
torch_first -q
"$PY" -m pip install -q "auto-round==$AUTOROUND_VERSION" -c "$CONSTRAINTS"
check
