"""One clean line per event: a data warning once, in words; no source locations in log lines; no library progress
bars outside a terminal unless asked; a mistyped local path refused at once, never looked up on the Hub."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import refused
from typer.testing import CliRunner

from toolkit.cli import app

CLI = [sys.executable, "-c", "from toolkit.cli import app; app()"]  # a real process: pytest records warnings itself
LOCATION = re.compile(r"\w\.py:\d+")  # "cli.py:34", "suite.py:62"


def compound(*args, **env):
    proc = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "80", **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def cut_dataset(tmp_path_factory):
    """A JSON array of 60 records that ends inside the 61st (a truncated download)."""
    records = [{"text": f"Record {i}: " + "the quick brown fox jumps over the lazy dog. " * 8} for i in range(61)]
    text = json.dumps(records)
    path = tmp_path_factory.mktemp("cut") / "cut.json"
    path.write_text(text[: text.rindex('{"text"') + 30])
    return path


def test_a_data_warning_is_one_plain_line_and_no_line_carries_a_source_location(tmp_path, tiny_llama_dir,
                                                                                  cut_dataset):
    output = compound("quantize", "--model", tiny_llama_dir, "--method", "gptq", "--group-size", "32", "--dataset",
                      cut_dataset, "--samples", "2", "--seq-len", "32", "--output", tmp_path / "q")
    said = [line for line in output.splitlines() if "truncated" in line]
    assert len(said) == 1 and said[0].startswith("warning: ") and "after 60 complete records" in said[0], output
    assert "UserWarning" not in output and "warnings.warn(" not in output
    assert not LOCATION.search(output), output


def test_library_progress_bars_stay_off_outside_a_terminal_unless_asked(tiny_llama_dir):
    args = ("decode", "--model", tiny_llama_dir, "--prompt", "Hi", "--max-new-tokens", "2")
    assert "Loading weights" not in compound(*args)  # transformers' tqdm bar while it reads the weights
    assert "Loading weights" in compound(*args, HF_HUB_DISABLE_PROGRESS_BARS="0")


@pytest.mark.slow
def test_the_gguf_readers_bar_stays_off_outside_a_terminal():
    """transformers' GGUF reader calls tqdm itself, past its own switch: the embedded model loads silently."""
    output = compound("decode", "--model", "smollm2-135m", "--prompt", "Hi", "--max-new-tokens", "1")
    assert "de-quantizing GGUF tensors" not in output, output


@pytest.mark.parametrize("spec", ["./tiny-lama", "~/no-such-dir/model", "models/tiny/lama", "/no/such/model",
                                  "tiny-lama.gguf"])
def test_a_mistyped_local_path_is_refused_without_asking_the_hub(tmp_path, monkeypatch, spec):
    import toolkit.models

    def asked(*args, **kwargs):
        raise AssertionError("the Hub was asked about a local path")

    monkeypatch.setattr(toolkit.models, "hub_unreachable", asked)
    monkeypatch.setattr(toolkit.models, "_hub_call", asked)
    result = CliRunner().invoke(app, ["quantize", "--model", spec, "--method", "rtn", "--output", tmp_path / "q"])
    refused(result, "does not exist")
