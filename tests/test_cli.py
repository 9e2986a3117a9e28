"""The command line on a tiny local model: success path and the errors a user meets first."""

import json

import pytest
from typer.testing import CliRunner

from conftest import refused
from toolkit.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_quantize_and_eval_tiny_model(tmp_path, tiny_llama_dir):
    out = tmp_path / "q"
    result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--group-size", "32", "--output", out,
                 "--eval", "--eval-windows", "2", "--seq-len", "64")
    assert result.exit_code == 0, result.output
    assert "wall time" in result.output and (out / "compound.json").is_file()
    assert "perplexity, quantized" in result.output and "held-out tokens scored" in result.output
    result = run("eval", "--model", out, "--base", tiny_llama_dir, "--windows", "2", "--seq-len", "64")
    assert result.exit_code == 0, result.output
    assert "126" in result.output  # 2 windows × 63 predicted tokens, for each model


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/no/such/dir"], "does not exist"),
        (["--group-size", "48"], "group_size must be one of"),
        (["--bits", "9"], "bits must be between 2 and 8"),
        (["--method", "hqq"], "Invalid value for '--method'"),
        (["--asym", "--format", "gptq"], "asymmetric GPTQ checkpoints are refused"),
        (["--bits", "3", "--format", "awq"], "AWQ GEMM format stores 4-bit weights only"),
        (["--bits", "3"], "no layout stores asymmetric 3-bit weights (AWQ stores 4 bits, compressed-tensors 4 or 8); "
                          "pass --sym (the GPTQ layout stores 2, 3, 4, 8 bits)"),
        (["--dataset", "/no/such/file.jsonl", "--method", "gptq"], "does not exist"),
    ],
)
def test_bad_input_gets_a_clear_error_and_no_output(tmp_path, tiny_llama_dir, args, message):
    out = tmp_path / "q"
    base = ["quantize", "--model", tiny_llama_dir, "--group-size", "32", "--output", out]
    result = run(*base, *args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not out.exists()


def test_group_size_not_dividing_width(tmp_path, tiny_llama_dir):
    result = run("quantize", "--model", tiny_llama_dir, "--group-size", "128", "--output", tmp_path / "q")
    assert result.exit_code == 2
    assert "does not divide the input width" in " ".join(result.output.split())


@pytest.mark.parametrize("args,quant_method", [([], "awq"), (["--sym"], "gptq"), (["--bits", "8"], "compressed-tensors")])
def test_auto_format_picks_a_layout_engines_serve(tmp_path, tiny_llama_dir, args, quant_method):
    out = tmp_path / "q"
    result = run("quantize", "--model", tiny_llama_dir, "--group-size", "32", "--output", out, *args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == quant_method


def test_existing_output_is_not_clobbered(tmp_path, tiny_llama_dir):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run("quantize", "--model", tiny_llama_dir, "--group-size", "32", "--output", out)
    assert result.exit_code == 2 and "--overwrite" in result.output
    assert (out / "keep.txt").read_text() == "mine"


def test_decode_a_float_and_a_quantized_tiny_model(tmp_path, tiny_llama_dir):
    result = run("decode", "--model", tiny_llama_dir, "--prompt", "Name three colours.", "--max-new-tokens", "6")
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.output and "greedy" in result.output
    assert "new tokens" in result.output and "prompt tokens" in result.output
    assert "load (read weights, pack int4)" in result.output
    from toolkit.runtime import decode_step

    step = "C++ decode step" if decode_step.load() is not None else "torch forward"
    assert f"CPU kernels {step}" in " ".join(result.output.replace("│", " ").split())  # a float model: no int4 kernel
    out = tmp_path / "q"
    assert run("quantize", "--model", tiny_llama_dir, "--group-size", "32", "--output", out).exit_code == 0
    result = run("decode", "--model", out, "--prompt", "Hi", "--max-new-tokens", "4", "--kv-cache-dtype", "int8",
                 "--temperature", "0.8")
    assert result.exit_code == 0, result.output
    assert "T=0.8, KV cache int8" in result.output
    from toolkit.runtime.cpu_int4 import default_kernel

    assert f"int4 {default_kernel()}, torch forward" in " ".join(result.output.replace("│", " ").split())  # an INT8 cache: torch's


def test_decode_refuses_quantizes_kv_cache_flag_naming_its_own(tiny_llama_dir):
    """``--kv-cache`` is quantize's (which static scales a checkpoint calibrates); decode's setting is what its cache
    stores, ``--kv-cache-dtype`` (vLLM's name): one flag, one meaning."""
    result = run("decode", "--model", tiny_llama_dir, "--prompt", "Hi", "--kv-cache", "int8")
    refused(result, "No such option: --kv-cache", "--kv-cache-dtype", usage=True)
