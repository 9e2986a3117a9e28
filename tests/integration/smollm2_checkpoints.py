"""Compound checkpoints of the real SmolLM2, shared by every integration test that hands them to a loader compound
did not write (vLLM, GPTQModel, transformers); a pytest plugin (``tests/conftest.py``), so each is built once per
session whichever modules use it.

Two RTN W4 g64 quantizations, symmetric (GPTQ layout, with FP8 KV-cache scales) and asymmetric (AWQ layout), run
side by side, and ``compound convert`` of each to compressed-tensors (conversions are bit-exact re-packs,
tests/test_convert.py): four layouts from two quantizations. Beside them a third, symmetric over the full code range
(``--full-range``, GPTQ layout): scales negative wherever a group's largest-magnitude weight is positive.
"""

from pathlib import Path

import pytest
from integration.side_by_side import held_out_windows, run_side_by_side

QUANTIZE = ["compound", "quantize", "--model", "smollm2-135m", "--method", "rtn", "--bits", "4", "--group-size", "64"]
BUILDS = {  # name: the command that makes it ("{name}" stands for another checkpoint's directory)
    "gptq": [*QUANTIZE, "--sym", "--format", "gptq", "--kv-cache", "fp8", "--samples", "8", "--seq-len", "256"],
    "awq": [*QUANTIZE, "--asym"],
    "gptq-full-range": [*QUANTIZE, "--sym", "--full-range", "--format", "gptq"],  # negative scales where max > 0
    "compressed-tensors-sym": ["compound", "convert", "--model", "{gptq}", "--format", "compressed-tensors"],
    "compressed-tensors-asym": ["compound", "convert", "--model", "{awq}", "--format", "compressed-tensors"],
}
WINDOWS, SEQ_LEN = 4, 128  # held-out windows every loader scores


@pytest.fixture(scope="session")
def smollm2_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """{name in BUILDS: checkpoint directory}."""
    root = tmp_path_factory.mktemp("smollm2-checkpoints")
    paths = {name: root / name for name in BUILDS}
    for stage in (("gptq", "awq", "gptq-full-range"), ("compressed-tensors-sym", "compressed-tensors-asym")):
        run_side_by_side({name: [arg.format(**paths) for arg in BUILDS[name]] + ["--output", str(paths[name])]
                  for name in stage})
    return paths


@pytest.fixture(scope="session")
def smollm2_windows(smollm2_checkpoints, tmp_path_factory):
    """(held-out token windows [WINDOWS, SEQ_LEN], the same windows as a JSON file for the loaders' scripts)."""
    return held_out_windows(smollm2_checkpoints["gptq"], WINDOWS, SEQ_LEN, tmp_path_factory.mktemp("tokens"))
