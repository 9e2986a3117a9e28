"""The quantize verb (toolkit/quantize.py): every option is checked before any work, whatever the method, and an
evaluation that fails after the write keeps the checkpoint and says how to evaluate it."""

import pytest
from typer.testing import CliRunner

from conftest import refused
from toolkit.cli import app
from toolkit.formats.checkpoint import verify_manifest

runner = CliRunner()


TINY = ["--group-size", "32"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("args,message", [
    (["--method", "rtn", "--samples", "-5"], "--samples"),
    (["--method", "rtn", "--seq-len", "1"], "--seq-len"),
    (["--method", "rtn", "--eval", "--dataset", "/no/such/file.jsonl"], "--dataset /no/such/file.jsonl"),
    (["--method", "rtn", "--eval", "--eval-windows", "0"], "--eval-windows must be >= 1"),
    (["--method", "gptq", "--dataset", "/no/such/file.jsonl"], "does not exist"),
])
def test_bad_options_are_refused_before_any_work(runs, tiny_llama_dir, monkeypatch, args, message):
    from toolkit.models import ModelSource

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(ModelSource, "tokenizer", never)
    result = run("quantize", "--model", tiny_llama_dir, *TINY, *args, "-o", runs / "q")
    refused(result, message)
    assert list(runs.iterdir()) == []


def test_eval_failing_after_the_write_keeps_the_checkpoint_and_says_how_to_evaluate(runs, tmp_path, tiny_llama_dir):
    short = tmp_path / "short.txt"
    short.write_text("A few words.\n\nAnd a few more.\n")
    out = runs / "q"
    result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "-o", out, "--eval",
                 "--dataset", short, "--seq-len", "64", "--eval-windows", "4")
    text = refused(result, "--eval failed", "is complete and valid", f"compound eval --model {out}")
    assert "wall time" in text  # the quantize report still printed
    assert [p.name for p in runs.iterdir()] == ["q"] and verify_manifest(out) == []
