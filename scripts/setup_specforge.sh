#!/usr/bin/env bash
# Create a SpecForge (SGLang project's draft-head trainer) virtual env, by default at .venvs/specforge inside the
# repo: the EAGLE-3 peer of benchmarks/heads_vs_peers.py (runner: benchmarks/peers/heads_specforge.py).
#
#   bash scripts/setup_specforge.sh [VENV]     # idempotent: does nothing when specforge imports from the venv
#
# torch is installed first (venv_common.sh's torch_first), then specforge with --no-deps and its requirements listed
# below. specforge 0.2.0 pins torch==2.11.0, transformers==5.8.1 and sglang==0.5.14; with torch pinned to 2.13.0 pip
# answers "ResolutionImpossible: specforge 0.2.0 depends on torch==2.11.0". sglang 0.5.14 itself pins torch==2.11.0,
# torchaudio==2.11.0 and CUDA-only packages (flashinfer_python[cu13], cuda-python, sglang-kernel, sgl-deep-gemm,
# nvidia-cutlass-dsl[cu13], flash-attn-4), so it is not installed: SpecForge needs it only to capture hidden states
# from a live SGLang server (online training, or its offline data generation); offline training from feature files,
# which benchmarks/peers/heads_data.py writes from compound's own cache, does not import it.
# triton is added: specforge.core.loss imports it unconditionally (CUDA torch wheels bring it, the CPU one does not).
# Triton has no CPU driver, so SpecForge's KL kernel runs on CPU only under TRITON_INTERPRET=1 (Triton's interpreter);
# the runner sets it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh"

venv_init specforge SpecForge "$@"
SPECFORGE_VERSION="${SPECFORGE_VERSION:-0.2.0}"
TRITON_VERSION="${TRITON_VERSION:-3.9.0}"
export CUDA_VISIBLE_DEVICES=""

check() {
    torch_check <<'PY'
import importlib.metadata as md
import triton, yunchang  # noqa: F401
import specforge  # noqa: F401
from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: F401  (imports the triton loss)
from specforge.application import build_application_run  # noqa: F401  (the `specforge train` path)
print("specforge", md.version("specforge"), "torch", torch.__version__, "transformers", md.version("transformers"),
      "triton", triton.__version__)
PY
}

exit_if_ready
venv_create "$SETUPTOOLS"
torch_first -q
"$PY" -m pip install -q --no-deps "specforge==$SPECFORGE_VERSION"
# specforge 0.2.0's Requires-Dist, less torch (installed above) and sglang (see the header); plus triton
"$PY" -m pip install -q -c "$CONSTRAINTS" \
    "transformers==5.8.1" datasets tqdm accelerate huggingface-hub numpy openai-harmony pydantic psutil pyyaml \
    safetensors requests tensorboard typing-extensions wandb yunchang "triton==$TRITON_VERSION"
check
