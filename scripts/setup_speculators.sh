#!/usr/bin/env bash
# Create a speculators (vLLM project's draft-head trainer) virtual env, by default at .venvs/speculators inside the
# repo: the EAGLE-3 peer of benchmarks/heads_vs_peers.py (runner: benchmarks/peers/heads_speculators.py).
#
#   bash scripts/setup_speculators.sh [VENV]     # idempotent: does nothing when speculators imports from the venv
#
# torch is installed first (venv_common.sh's torch_first), then speculators with --no-deps and its own requirements
# listed below. speculators 0.9.0 requires torchvision and torchaudio but imports neither; the torchvision matching
# torch 2.13.0 on PyPI (0.28.0) is a CUDA build whose ops do not register with the CPU torch ("RuntimeError: operator
# torchvision::nms does not exist"), and transformers imports torchvision whenever it is installed, which then breaks
# `from transformers import PreTrainedModel` and so `import speculators`. They are therefore left out.
# Training itself needs an accelerator (speculators' Trainer moves the draft to device index 0); the venv still
# converts data, builds and saves drafts (--dry-run) on CPU. See benchmarks/peers/heads_speculators.py.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv_common.sh"

venv_init speculators speculators "$@"
SPECULATORS_VERSION="${SPECULATORS_VERSION:-0.9.0}"
export CUDA_VISIBLE_DEVICES=""

check() {
    torch_check <<'PY'
import importlib.metadata as md
for name in ("torchvision", "torchaudio"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"{name} is installed in the speculators venv: its CUDA build breaks transformers' imports")
import datasets, hs_connectors, speculators  # noqa: F401
from speculators.train.config import TrainConfig  # noqa: F401  (the `speculators train` entry point)
print("speculators", md.version("speculators"), "torch", torch.__version__, "transformers", md.version("transformers"))
PY
}

exit_if_ready
venv_create "$SETUPTOOLS"
torch_first -q
"$PY" -m pip uninstall -q -y torchvision torchaudio 2>/dev/null || true
"$PY" -m pip install -q --no-deps "speculators==$SPECULATORS_VERSION"
# speculators 0.9.0's Requires-Dist, less torch (installed above), torchvision and torchaudio (see the header)
"$PY" -m pip install -q -c "$CONSTRAINTS" \
    aiohttp click "datasets>=4.0.0,<=5.1.0" httpx huggingface-hub "loguru>=0.7.2,<=0.7.3" "numpy>=2.0.0,<=2.5.4" \
    "openai>=2.0.0" protobuf psutil "pydantic>=2.0.0" "pydantic-settings>=2.0.0" rich safetensors \
    "tqdm>=4.66.3,<=4.70.1" "transformers>=5.0.0,<=5.19.0" "typer>=0.12.0" "hs-connectors==$SPECULATORS_VERSION"
check
