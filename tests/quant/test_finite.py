import itertools

import pytest
import torch
from typer.testing import CliRunner

from conftest import refused
from toolkit.cli import app
from toolkit.quant.finite import all_finite


@pytest.mark.parametrize("dtype, bad", list(itertools.product(
    [torch.float32, torch.bfloat16, torch.float16], [None, "nan", "inf", "-inf", "inf and -inf"])))
def test_all_finite_agrees_with_isfinite(dtype, bad):
    torch.manual_seed(0)
    t = torch.randn(4, 64, 96).to(dtype)
    if bad == "inf and -inf":
        t[1, 2, 3], t[3, 60, 0] = float("inf"), float("-inf")
    elif bad is not None:
        t[2, 10, 50] = float(bad)
    assert all_finite(t) == bool(torch.isfinite(t).all()) == (bad is None)


def test_half_precision_sums_in_float32():
    # 4,096 values of 60,000 sum far past float16's range; the values themselves are finite
    assert all_finite(torch.full((4096,), 60000.0, dtype=torch.float16))


def test_only_false_alarm_is_a_float32_overflowing_sum():
    assert not all_finite(torch.tensor([3e38, 3e38]))


runner = CliRunner()


TINY = ["--group-size", "32"]


CALIBRATION = ["--samples", "4", "--seq-len", "32"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def model_dir(root, tokenizer, name, value, tensor="model.layers.1.mlp.down_proj.weight"):
    """A tiny Llama directory whose ``tensor`` has ``value`` at [0, 0]."""
    from conftest import tiny_model

    model = tiny_model("llama")
    with torch.no_grad():
        model.get_parameter(tensor)[0, 0] = value
    path = root / name
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory, smol_tokenizer):
    root = tmp_path_factory.mktemp("broken-models")
    return {
        "nan": model_dir(root, smol_tokenizer, "nan", float("nan")),
        "inf": model_dir(root, smol_tokenizer, "inf", float("inf")),
        "huge": model_dir(root, smol_tokenizer, "huge", 1e6, tensor="model.embed_tokens.weight"),
    }


@pytest.mark.parametrize("method,kind,extra", [("rtn", "nan", []), ("gptq", "inf", CALIBRATION),
                                                ("rtn", "nan", ["--stream"])])
def test_non_finite_weights_stop_the_run_naming_layer_and_tensor(runs, broken_models, method, kind, extra):
    result = run("quantize", "--model", broken_models[kind], "--method", method, *TINY, *extra, "-o", runs / "q")
    refused(result, "non-finite weights", "model.layers.1.mlp.down_proj.weight", "decoder layer 1", "--model")
    assert list(runs.iterdir()) == []


def test_a_tensor_float16_cannot_hold_is_refused_naming_dtype(runs, broken_models):
    result = run("quantize", "--model", broken_models["huge"], "--method", "rtn", *TINY, "-o", runs / "q")
    refused(result, "non-finite tensor", "model.embed_tokens.weight", "--dtype bfloat16")
    assert list(runs.iterdir()) == []
