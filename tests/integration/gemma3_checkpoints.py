"""Compound W4 checkpoints of the real Gemma-3 270M, shared by the integration tests that hand them to a loader
compound did not write (llama.cpp, vLLM) and by the speculative-decoding test; a pytest plugin (``tests/conftest.py``),
so each is built once per session whichever modules use it (under xdist, modules that use it share the
``gemma3_checkpoints`` group).

Two RTN W4 g32 quantizations side by side, each with its GGUF file (``--gguf``): symmetric in the GPTQ layout (and
Q4_0), asymmetric in the AWQ layout (and Q4_1). RTN needs no calibration, so both take about a minute of CPU.
"""

from pathlib import Path

import pytest
from integration.side_by_side import held_out_windows, run_side_by_side

QUANTIZE = ["compound", "quantize", "--model", "gemma3-270m", "--method", "rtn", "--bits", "4", "--group-size", "32",
            "--gguf", "--threads", "1"]
BUILDS = {"gptq": [*QUANTIZE, "--sym", "--format", "gptq"], "awq": [*QUANTIZE, "--asym", "--format", "awq"]}
GGUF_TYPES = {"gptq": "Q4_0", "awq": "Q4_1"}  # the GGUF block type of each checkpoint's file
WINDOWS, SEQ_LEN = 2, 128  # held-out windows every loader scores (262k-entry logits: kept few)


@pytest.fixture(scope="session")
def gemma3_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """{name in BUILDS: checkpoint directory}; its GGUF file is ``gemma3_gguf(directory, name)``."""
    root = tmp_path_factory.mktemp("gemma3-checkpoints")
    run_side_by_side({name: [*cmd, "--output", str(root / name)] for name, cmd in BUILDS.items()})
    return {name: root / name for name in BUILDS}


def gemma3_gguf(checkpoints: dict[str, Path], name: str) -> Path:
    """The GGUF file ``quantize --gguf`` wrote beside checkpoint ``name``."""
    return checkpoints[name] / f"{name}-{GGUF_TYPES[name]}.gguf"


@pytest.fixture(scope="session")
def gemma3_windows(gemma3_checkpoints, tmp_path_factory):
    """(held-out token windows [WINDOWS, SEQ_LEN], the same windows as a JSON file for the loaders' scripts)."""
    return held_out_windows(gemma3_checkpoints["awq"], WINDOWS, SEQ_LEN, tmp_path_factory.mktemp("gemma3-tokens"))
