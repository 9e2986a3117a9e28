"""Compound checkpoints of the real SmolLM2, shared by every integration test that hands them to a loader compound
did not write (vLLM, GPTQModel, transformers); a pytest plugin (``tests/conftest.py``), so each is built once per
session whichever modules use it.

Two RTN W4 g64 quantizations, symmetric (GPTQ layout, with FP8 KV-cache scales) and asymmetric (AWQ layout), run
side by side, and ``compound convert`` of each to compressed-tensors (conversions are bit-exact re-packs,
tests/test_convert.py): four layouts from two quantizations.
"""

import json
import subprocess
from pathlib import Path

import pytest

QUANTIZE = ["compound", "quantize", "--model", "smollm2-135m", "--method", "rtn", "--bits", "4", "--group-size", "64"]
BUILDS = {  # name: the command that makes it ("{name}" stands for another checkpoint's directory)
    "gptq": [*QUANTIZE, "--sym", "--format", "gptq", "--kv-cache", "fp8", "--samples", "8", "--seq-len", "256"],
    "awq": [*QUANTIZE, "--asym"],
    "compressed-tensors-sym": ["compound", "convert", "--model", "{gptq}", "--format", "compressed-tensors"],
    "compressed-tensors-asym": ["compound", "convert", "--model", "{awq}", "--format", "compressed-tensors"],
}
WINDOWS, SEQ_LEN = 4, 128  # held-out windows every loader scores


def _run_all(commands: dict[str, list[str]]) -> None:
    """Run the commands side by side (each is mostly single-threaded Python), failing on the first error."""
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in commands.items()}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=1200)
        assert proc.returncode == 0, f"{name}: {output[-6000:]}"


@pytest.fixture(scope="session")
def smollm2_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """{name in BUILDS: checkpoint directory}."""
    root = tmp_path_factory.mktemp("smollm2-checkpoints")
    paths = {name: root / name for name in BUILDS}
    for stage in (("gptq", "awq"), ("compressed-tensors-sym", "compressed-tensors-asym")):
        _run_all({name: [arg.format(**paths) for arg in BUILDS[name]] + ["--output", str(paths[name])]
                  for name in stage})
    return paths


@pytest.fixture(scope="session")
def smollm2_windows(smollm2_checkpoints, tmp_path_factory):
    """(held-out token windows [WINDOWS, SEQ_LEN], the same windows as a JSON file for the loaders' scripts)."""
    from transformers import AutoTokenizer

    from toolkit.calibration import eval_windows

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoints["gptq"])
    tokens = eval_windows(tokenizer, "sharegpt", windows=WINDOWS, seq_len=SEQ_LEN)
    path = tmp_path_factory.mktemp("tokens") / "windows.json"
    path.write_text(json.dumps(tokens.tolist()))
    return tokens, path
