"""``compound validate`` prints each check as it finishes, in order, before the final tables, and words act-order as
the manifest records it."""

import re

import pytest
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.quant.configs import GPTQConfig, RTNConfig
from toolkit.quantize import CalibrationSpec, quantize
from toolkit.validate import serving_preview

CHECKS = ("manifest: ", "loaded: ", "cpu-int4: ok", "triton: ok", "decode loop: ok", "serving preview: vLLM on GPU")


@pytest.fixture(scope="module")
def rtn_dir(tmp_path_factory, tiny_llama_dir):
    return quantize(str(tiny_llama_dir), RTNConfig(group_size=32), tmp_path_factory.mktemp("lines") / "q").output


def test_each_check_prints_a_line_as_it_finishes_then_the_tables(rtn_dir):
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["validate", "--model", str(rtn_dir)])
    assert result.exit_code == 0, result.output
    lines = [re.sub(r"^\[[\d:]+\] ", "", " ".join(line.split())) for line in result.output.splitlines()]  # log times
    found = [next(i for i, line in enumerate(lines) if line.startswith(check)) for check in CHECKS]
    assert found == sorted(found), lines
    assert "SHA-256 intact" in lines[found[0]] and "top-1 100.00%" in lines[found[3]]
    assert "greedy: 16/16 tokens identical to" in lines[found[4]]
    table = next(i for i, line in enumerate(lines) if line.startswith("runtime paths vs the reference"))
    assert table > found[-1]  # the final tables come after every check's line
    for phase in ("reference path: 2/2 done", "cpu-int4 path: 2/2 done", "decode loop vs transformers.generate: 2/2"):
        assert any(phase in line for line in lines), phase


def test_act_order_is_worded_as_the_manifest_records_it(tmp_path, tiny_llama_dir, rtn_dir):
    gptq_dir = quantize(str(tiny_llama_dir), GPTQConfig(group_size=32, sym=False), tmp_path / "g",
                        CalibrationSpec(samples=4, seq_len=32)).output
    shapes = [(64, 64)]
    assert serving_preview(gptq_dir, shapes).scheme.endswith("act-order on (static groups)")  # written as AWQ
    assert serving_preview(rtn_dir, shapes).scheme.endswith("act-order off")
