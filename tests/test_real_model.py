"""The real model end to end through the installed `compound` command: SmolLM2-135M-Instruct, RTN W4 g64."""

import json
import os
import subprocess

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

def compound(*args, check=True):
    result = subprocess.run(["compound", *map(str, args)], capture_output=True, text=True, env=os.environ.copy())
    if check and result.returncode:
        raise AssertionError(result.stdout + result.stderr)
    return result


@pytest.fixture(scope="module")
def rtn_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "smollm2-rtn-w4g64"
    compound("quantize", "--model", "smollm2-135m", "--method", "rtn", "--sym", "--bits", "4", "--group-size", "64",
             "--output", out)
    return out


def test_checkpoint_is_gptq_and_four_times_smaller(rtn_checkpoint):
    config = json.loads((rtn_checkpoint / "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == ("gptq", 4, 64, True, False)
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    tensors = load_file(rtn_checkpoint / "model.safetensors")
    modules = {k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")}
    assert len(modules) == 30 * 7
    packed_bytes = sum(tensors[f"{m}.{s}"].numel() * tensors[f"{m}.{s}"].element_size()
                       for m in modules for s in ("qweight", "qzeros", "scales", "g_idx"))
    fp16_bytes = sum(tensors[f"{m}.qweight"].shape[0] * 8 * tensors[f"{m}.qweight"].shape[1] * 2 for m in modules)
    assert 3.5 < fp16_bytes / packed_bytes < 4.0


def test_eval_reports_slices_next_to_float(rtn_checkpoint, tmp_path):
    """The generation checks on the real model run in the demo recipe's test (tests/hub/test_demo_recipe.py)."""
    out = tmp_path / "eval"
    stdout = compound("eval", "--model", rtn_checkpoint, "--base", "smollm2-135m", "--windows", "1", "--seq-len",
                      "256", "--no-generation", "--output", out).stdout
    report = json.loads((out / "eval.json").read_text())
    assert f"degrades most: {report['worst_slice']}" in stdout
    slices = report["slices"]
    assert all(row["tokens"] == 255 for row in slices.values()) and report["overall"]["tokens"] == 4 * 255
    for row in slices.values():  # RTN W4 g64 moves SmolLM2 visibly on every slice, and breaks none of them
        assert 1.05 < row["perplexity_ratio"] < 2.0 and 0.05 < row["kl"] < 2.0
        assert 0.4 < row["top1_agreement"] < row["top5_agreement"] < 1.0
    layers = report["layer_errors"]["layers"]
    assert len(layers) == 30 and all(0.05 < e < 0.2 for e in layers)  # RTN's relative weight error per layer
    assert {p.name for p in out.iterdir()} == {"eval.json", "eval.md", "slices.png", "kl_histogram.png",
                                               "layer_errors.png"}


def test_group_size_128_is_refused_on_width_576(tmp_path):
    result = compound("quantize", "--method", "rtn", "--group-size", "128", "--output", tmp_path / "x", check=False)
    assert result.returncode == 2
    assert "576 % 128 = 64" in " ".join(result.stderr.split()) and not (tmp_path / "x").exists()
