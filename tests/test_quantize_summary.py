"""What ``compound quantize`` says about its run, at 80 columns: the group size it chose (or its refusal before any
weight loads), the format written and why, act-order in the manifest's words, the error measure of each layer, and
quantize, eval and total wall time apart."""

import json

import pytest
from typer.testing import CliRunner

from toolkit.cli import app

NARROW = {"COLUMNS": "80"}


def run(*args):
    return CliRunner(env=NARROW).invoke(app, [str(a) for a in args])


def unwrapped(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


def assert_fits_80_columns(output: str) -> None:
    for line in output.splitlines():
        assert len(line) <= 80 and "…" not in line, line


def test_default_group_size_fits_the_model_and_says_why(tmp_path, tiny_llama_dir):
    out = tmp_path / "q"
    result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--output", out)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "compound.json").read_text())
    assert manifest["quantization"]["group_size"] == 64  # hidden 64, MLP 128: 128 does not divide 64
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 64
    text = unwrapped(result.output)
    assert "compound quantize: rtn W4 g64" in text
    assert "group size 64 (auto: the largest of 128, 64, 32 dividing every input width; 128 does not divide 64" in text
    assert_fits_80_columns(result.output)


def test_an_invalid_group_size_is_refused_before_any_weight_loads(tmp_path, tiny_llama_dir, monkeypatch):
    from toolkit.models import ModelSource

    loaded = []
    monkeypatch.setattr(ModelSource, "load", lambda *a, **k: loaded.append("model"))
    monkeypatch.setattr(ModelSource, "tokenizer", lambda *a, **k: loaded.append("tokenizer"))
    result = run("quantize", "--model", tiny_llama_dir, "--group-size", "128", "--output", tmp_path / "q")
    assert result.exit_code == 2, result.output
    assert "group_size 128 does not divide the input width" in unwrapped(result.output)
    assert loaded == [] and not (tmp_path / "q").exists()


def test_summary_names_format_act_order_measure_and_times(tmp_path, tiny_llama_dir):
    out = tmp_path / "q"
    result = run("quantize", "--model", tiny_llama_dir, "--method", "gptq", "--asym", "--samples", "4",
                 "--seq-len", "32", "--output", out, "--eval", "--eval-windows", "3", "--threads", "1")
    assert result.exit_code == 0, result.output
    text = unwrapped(result.output)
    manifest = json.loads((out / "compound.json").read_text())
    assert manifest["format"] == "awq" and manifest["quantization"]["act_order"] is True
    assert ("format awq (auto: asymmetric 4-bit act-order weights with static groups (no g_idx needed) are written "
            "in the AWQ layout, since engines load GPTQ checkpoints only symmetric)") in text
    assert "act-order on (static groups)" in text
    for index in (0, 1):
        assert f"layer {index}: largest Hessian-weighted squared error (GPTQ loss) " in text
    times = {}
    for name in ("quantize wall time", "eval wall time", "total wall time"):
        assert name in text, name
        times[name] = float(text.split(name + " ")[1].split(" s")[0])
    assert times["total wall time"] == pytest.approx(times["quantize wall time"] + times["eval wall time"], abs=0.11)
    assert "held-out tokens scored 93 (3 windows)" in text  # 3 × 31 predicted tokens
    assert "quantized / float ×" in text and "95 % CI" in text and "threads 1 thread (--threads)" in text
    assert_fits_80_columns(result.output)
