"""Gemma-3 270M, the second embedded real model and a base model (no chat template), end to end through the installed
`compound` command: the default ShareGPT calibration, `eval` against the float model and `decode` all render its
conversations as plain text, and say so once."""

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.slow

PLAIN_TEXT_LINE = "warning: the tokenizer has no chat template (a base model)"


def compound(*args):
    result = subprocess.run(["compound", *map(str, args)], capture_output=True, text=True, env=os.environ.copy())
    if result.returncode:
        raise AssertionError(result.stdout + result.stderr)
    return result


@pytest.fixture(scope="module")
def gptq_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3") / "gemma3-270m-gptq"
    return out, compound("quantize", "--model", "gemma3-270m", "--method", "gptq", "--asym", "--samples", "16",
                         "--seq-len", "256", "--output", out)


def test_quantize_calibrates_a_base_model_on_sharegpt(gptq_run):
    out, result = gptq_run
    assert result.stderr.count(PLAIN_TEXT_LINE) == 1
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    assert config["model_type"] == "gemma3_text" and config["num_hidden_layers"] == 18
    assert (quant["quant_method"], quant["bits"], quant["group_size"]) == ("awq", 4, 128)  # 640 = 5 × 128
    manifest = json.loads((out / "compound.json").read_text())
    assert manifest["model"] == "gemma3-270m"


def test_eval_scores_the_base_model_on_plain_text(gptq_run, tmp_path):
    out, _ = gptq_run
    result = compound("eval", "--model", out, "--base", "gemma3-270m", "--windows", "1", "--seq-len", "256",
                      "--no-generation", "--output", tmp_path / "eval")
    assert result.stderr.count(PLAIN_TEXT_LINE) == 1
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    overall = report["overall"]  # GPTQ W4 g128 on 16×256 tokens: close to the float model, not equal to it
    assert 1.0 < overall["perplexity_ratio"] < 1.5 and 0.0 < overall["kl"] < 0.5


def test_decode_continues_a_plain_text_prompt(gptq_run):
    out, _ = gptq_run
    result = compound("decode", "--model", out, "--prompt", "The capital of France is Paris. The capital of Italy is",
                      "--max-new-tokens", "8")
    assert result.stderr.count(PLAIN_TEXT_LINE) == 1
    assert result.stdout.strip()
