"""Inputs that used to give tracebacks or misleading messages, and context lengths (issue #26, items 6 and 7): every
case exits 2 with one line that names the file or the flag to change, prints no traceback, and leaves nothing beside
the output."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from conftest import refused
from toolkit.cli import app

runner = CliRunner()
GPTQ = ["--method", "gptq", "--group-size", "32", "--samples", "2", "--seq-len", "16"]
EVAL = ["--windows", "1", "--seq-len", "16", "--no-generation"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def runs(runs):
    """conftest's ``runs``, checked to be empty again when the case ends."""
    yield runs
    assert list(runs.iterdir()) == []


def copy_model(source, target, config=None, truncate=None):
    """A copy of a model directory, its config.json replaced by ``config`` (text or a dict) when given and its
    weights cut to ``truncate`` bytes when given."""
    shutil.copytree(source, target)
    if config is not None:
        (target / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if truncate is not None:
        os.truncate(target / "model.safetensors", truncate)
    return target


def config_of(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    return {k: v for k, v in {**config, **changes}.items() if v is not None}


@pytest.fixture(scope="module")
def rtn_checkpoint(tmp_path_factory, tiny_llama_dir):
    out = tmp_path_factory.mktemp("bad-inputs") / "rtn"
    assert run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--group-size", "32", "-o", out).exit_code == 0
    return out


# 6: files given as --model


def test_truncated_safetensors_model_names_the_file(tmp_path, runs, tiny_llama_dir):
    model = copy_model(tiny_llama_dir, tmp_path / "cut", truncate=1000)
    text = refused(run("quantize", "--model", model, *GPTQ, "-o", runs / "q"), "cut/model.safetensors",
                   "truncated or corrupt")
    assert "Hub" not in text


def test_truncated_safetensors_checkpoint_names_the_file(tmp_path, runs, rtn_checkpoint):
    checkpoint = copy_model(rtn_checkpoint, tmp_path / "cut", truncate=1000)
    refused(run("decode", "--model", checkpoint, "--prompt", "Hi", "--max-new-tokens", "2"),
            "cut/model.safetensors", "truncated or corrupt")


def test_config_that_is_not_json_is_not_called_a_hub_problem(tmp_path, runs, tiny_llama_dir):
    model = copy_model(tiny_llama_dir, tmp_path / "broken", config='{"model_type": "llama",\n"hidden_size": }')
    text = refused(run("quantize", "--model", model, "-o", runs / "q"), "broken/config.json is not valid JSON",
                   "line 2")
    assert "Hub" not in text


def test_config_without_model_type(tmp_path, runs, tiny_llama_dir):
    model = copy_model(tiny_llama_dir, tmp_path / "typeless", config=config_of(tiny_llama_dir, model_type=None))
    refused(run("eval", "--model", model, *EVAL, "-o", runs / "report"), "typeless/config.json has no model_type")


def test_custom_code_model_names_the_flag(tmp_path, runs, tiny_llama_dir):
    auto_map = {"AutoConfig": "configuration_fancy.FancyConfig", "AutoModelForCausalLM": "modeling_fancy.Fancy"}
    model = copy_model(tiny_llama_dir, tmp_path / "fancy",
                       config=config_of(tiny_llama_dir, model_type="fancy", auto_map=auto_map))
    text = refused(run("quantize", "--model", model, "-o", runs / "q"), "auto_map", "--trust-remote-code")
    assert "trust_remote_code=True" not in text


def test_mistyped_local_path_is_not_looked_up_on_the_hub(tmp_path, runs, monkeypatch):
    import toolkit.models

    def never(*_):
        raise AssertionError("a mistyped local path was looked up on the Hub")

    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(toolkit.models, "hub_unreachable", never)
    refused(run("quantize", "--model", "models/tiny-lama", "-o", runs / "q"),
            "model path models/tiny-lama does not exist")


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compound_unreachable_hub(tmp_path, *args):
    """``compound *args`` in a process that may use the Hub (no offline mode) whose endpoint is a closed local port:
    (result, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HUB_CACHE": str(tmp_path / "hub-cache"),
            "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", "from toolkit.cli import app; app()", *map(str, args)],
                            capture_output=True, text=True, env=env, timeout=120, check=False)
    return result, time.perf_counter() - started


@pytest.mark.parametrize("args,needle", [
    (["--model", "some-org/some-model"], "some-org/some-model is not in the local Hugging Face cache"),
    (["--dataset", "some-org/some-dataset", *GPTQ], "could not load dataset some-org/some-dataset"),
])
def test_unreachable_hub_fails_fast(tmp_path, runs, tiny_llama_dir, args, needle):
    result, seconds = compound_unreachable_hub(tmp_path, "quantize", "--model", tiny_llama_dir, *args, "-o", runs / "q")
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert "is unreachable" in output and needle in output and "Traceback" not in output
    assert "Retrying" not in output and seconds < 30, (seconds, output)  # before: five retries per file, ~50 s


def test_cached_hub_model_still_loads_when_the_hub_is_unreachable(tmp_path, tiny_llama_dir):
    snapshot = tmp_path / "hub-cache" / "models--some-org--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for file in tiny_llama_dir.iterdir():
        (snapshot / file.name).symlink_to(file)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    result, _ = compound_unreachable_hub(tmp_path, "decode", "--model", "some-org/tiny", "--prompt", "Hi",
                                         "--max-new-tokens", "2")
    assert result.returncode == 0, result.stdout + result.stderr


# 6: calibration and eval data


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_missing_text_column_names_the_flag_and_the_columns(tmp_path, runs, tiny_llama_dir, suffix):
    rows = [{"body": f"document {i} " * 20, "meta": i} for i in range(64)]
    source = tmp_path / f"data{suffix}"
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), source)
    else:
        source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = refused(run("quantize", "--model", tiny_llama_dir, *GPTQ, "--dataset", source, "-o", runs / "q"),
                   "has no 'text' field", "['body', 'meta']", "--text-field")
    assert "text_field=" not in text


def test_tiny_calibration_text_asks_for_a_larger_dataset(tmp_path, runs, tiny_llama_dir):
    source = tmp_path / "tiny.txt"
    source.write_text("abc")
    text = refused(run("quantize", "--model", tiny_llama_dir, *GPTQ, "--dataset", source, "-o", runs / "q"),
                   "pass a larger --dataset")
    assert "lower --samples" not in text


def test_tiny_eval_text_asks_for_a_larger_dataset(tmp_path, runs, tiny_llama_dir):
    source = tmp_path / "tiny.txt"
    source.write_text("abc")
    refused(run("eval", "--model", tiny_llama_dir, *EVAL, "--dataset", source, "-o", runs / "report"),
            "--dataset")


@pytest.mark.parametrize("args,needle", [
    (["--windows", "0", "--seq-len", "16"], "--windows must be >= 1, got 0"),
    (["--windows", "1", "--seq-len", "-5"], "--seq-len must be >= 2, got -5"),
])
def test_eval_sizes_out_of_range(runs, tiny_llama_dir, args, needle):
    text = refused(run("eval", "--model", tiny_llama_dir, *args, "--no-generation", "-o", runs / "report"), needle)
    assert "lower --seq-len" not in text


# 6: results and recipes


def test_push_results_that_are_not_json_names_the_file(tmp_path, runs, rtn_checkpoint):
    results = tmp_path / "results.json"
    results.write_text("{not json")
    refused(run("push", rtn_checkpoint, "--repo", "someone/tiny", "--results", results),
            f"--results {results}: not valid JSON", "line 1")


def test_recipe_that_is_not_utf8(tmp_path, runs):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(f"model: smollm2-135m\noutput: {runs / 'out'}\n# caf\xe9\n".encode("latin-1"))
    offset = recipe.read_bytes().index(b"\xe9")
    refused(run("run", recipe), f"latin1.yaml: not UTF-8 text (byte {offset})")


# 7: context length


def test_quantize_seq_len_beyond_the_context(runs, tiny_llama_dir):
    refused(run("quantize", "--model", tiny_llama_dir, *GPTQ, "--seq-len", "512", "-o", runs / "q"),
            "--seq-len 512 exceeds the context length", "max_position_embeddings = 256", "--seq-len 256 or less")


def test_eval_seq_len_beyond_the_context(runs, rtn_checkpoint, tiny_llama_dir):
    refused(run("eval", "--model", rtn_checkpoint, "--base", tiny_llama_dir, "--windows", "1", "--seq-len", "300",
                "-o", runs / "report"), "--seq-len 300 exceeds", "max_position_embeddings = 256")


@pytest.mark.parametrize("prompt,new_tokens,needle", [
    ("word " * 300, 4, "shorten the prompt"),
    ("Hi", 1000, "lower --max-new-tokens to"),
])
def test_decode_beyond_the_context(runs, tiny_llama_dir, prompt, new_tokens, needle):
    refused(run("decode", "--model", tiny_llama_dir, "--prompt", prompt, "--max-new-tokens", new_tokens),
            "max_position_embeddings = 256", needle)
