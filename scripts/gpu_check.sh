#!/usr/bin/env bash
# compound's checks on one CUDA GPU, at most 8 minutes on an H100, as a markdown report in $OUT (default
# out/gpu-check): the Triton kernels of every format against the torch reference and their decode bandwidth,
# GPTQ and AWQ of a random 1B Llama on CUDA (and against the CPU), train-heads --head eagle3, compound decode,
# torchrun with NCCL. Without a CUDA device it says so and exits 0.
#
#   bash scripts/gpu_check.sh             # run the checks (installs compound with pip --no-deps -e . first)
#   bash scripts/gpu_check.sh --dry-run   # the plan, what would travel to a device machine, whether it fits 64 MiB
#
# The checks are the @pytest.mark.gpu tests of tests/gpu; scripts/gpu_check.py runs them and writes the report.
set -u
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
