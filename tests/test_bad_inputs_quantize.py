"""Bad input and faults on the quantize side (issue #26, items 1, 2, 3, 8, 9): every case exits 2 with one line that
names the problem and the flag to change, prints no traceback, and leaves nothing beside the output."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import refused
from toolkit.cli import app
from toolkit.formats import checkpoint
from toolkit.formats.checkpoint import MANIFEST, OutputError, atomic_directory, sha256_file, verify_manifest

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


# ---- item 1: non-finite weights, scales, tensors ------------------------------------------------------------------


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


def test_validate_says_non_finite_for_a_nan_scale(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "q"
    assert run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "-o", out).exit_code == 0
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.q_proj.scales"][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    manifest = json.loads((out / MANIFEST).read_text())  # re-hashed: the bytes are as written, the values are not
    manifest["files"]["model.safetensors"] = sha256_file(weights)
    (out / MANIFEST).write_text(json.dumps(manifest))
    result = run("validate", "--model", out)
    refused(result, "non-finite", "model.layers.0.self_attn.q_proj.scales")


def test_validate_marks_a_path_with_non_finite_logits():
    from toolkit.validate import CPU_INT4_TOLERANCE, _compare

    reference = torch.randn(1, 4, 8)
    got = reference.clone()
    got[0, 1, 2] = float("nan")
    result = _compare("cpu-int4", got, reference, "all", CPU_INT4_TOLERANCE)
    assert not result.ok and "non-finite" in result.note


# ---- item 2: leftovers of killed runs, the final rename ------------------------------------------------------------


def crash_leaving_siblings(output):
    """Leave what a killed run leaves beside ``output`` (a staging and an activations directory) and return their
    names: a child process enters both and exits without cleaning up."""
    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from toolkit.formats.checkpoint import atomic_directory, scratch_directory
        with atomic_directory(Path({str(output)!r})) as staging, scratch_directory(Path({str(output)!r})) as scratch:
            (staging / "model.safetensors").write_bytes(b"0" * 1000)
            (scratch / "000000.pt").write_bytes(b"0" * 1000)
            os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
    return sorted(p.name for p in output.parent.iterdir())


def test_a_run_removes_leftovers_of_killed_runs_for_its_output_only(runs, tiny_llama_dir):
    out = runs / "q"
    leftovers = crash_leaving_siblings(out)
    assert [name.split("-")[0] for name in leftovers] == [".q.activations", ".q.tmp"]
    dead_pid = leftovers[0].split("-")[1]
    unrelated = [".other.tmp-12345678", f".qq.tmp-{dead_pid}-0123abcd", f".q.tmp-{os.getpid()}-0123abcd", ".git"]
    for name in unrelated:  # another output's, a name only resembling ours, a live run's, a plain hidden dir
        (runs / name).mkdir()
    result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "-o", out)
    assert result.exit_code == 0, result.output
    assert "removed 2 leftover(s) of killed runs for q" in " ".join(result.output.split())
    assert sorted(p.name for p in runs.iterdir()) == sorted(["q", *unrelated])
    assert verify_manifest(out) == []


def test_kill_9_while_writing_then_rerun_gives_a_complete_checkpoint(runs, tmp_path, tiny_llama_dir):
    out = runs / "q"
    args = ["quantize", "--model", str(tiny_llama_dir), "--method", "gptq", *TINY, *CALIBRATION, "--stream",
            "--offload-activations", "-o", str(out)]
    script = textwrap.dedent("""
        import sys, time
        from toolkit.cli import app
        from toolkit.formats.checkpoint import ShardWriter
        write = ShardWriter.write
        def write_then_hang(self, tensors):  # the first layer's shard is on disk, the run is mid-write
            write(self, tensors)
            print("writing", flush=True)
            time.sleep(600)
        ShardWriter.write = write_then_hang
        app(sys.argv[1:])
    """)
    with open(tmp_path / "child.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout.readline().strip() == "writing", (tmp_path / "child.log").read_text()
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    left = sorted(p.name.split("-")[0] for p in runs.iterdir())
    assert left == [".q.activations", ".q.tmp"] and not out.exists()
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert "removed 2 leftover(s)" in " ".join(result.output.split())
    assert [p.name for p in runs.iterdir()] == ["q"]
    assert verify_manifest(out) == [] and (out / "model.safetensors.index.json").is_file()


def test_a_failing_final_rename_puts_the_old_output_back(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "old.txt").write_text("old")
    calls = []
    replace = os.replace

    def replace_failing_second(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # staging → output, after the old output was moved aside
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src), None, str(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_failing_second)
    with pytest.raises(OutputError, match="--output"), atomic_directory(out, overwrite=True) as staging:
        (staging / "new.txt").write_text("new")
    assert len(calls) == 3  # output → aside, staging → output (failed), aside → output
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert [p.name for p in out.iterdir()] == ["old.txt"] and (out / "old.txt").read_text() == "old"


# ---- item 3: the output cannot be written ---------------------------------------------------------------------------


def test_an_output_whose_parent_is_a_file_is_refused_before_work(runs, tiny_llama_dir):
    (runs / "file").write_text("mine")
    result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "-o", runs / "file" / "q")
    refused(result, "--output", "is a file, not a directory")
    assert [p.name for p in runs.iterdir()] == ["file"] and (runs / "file").read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits: the probe case below stands in for it")
def test_a_read_only_parent_is_refused_before_work(runs, tiny_llama_dir):
    runs.chmod(0o555)
    try:
        result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "-o", runs / "q")
    finally:
        runs.chmod(0o755)
    refused(result, "--output", "cannot create files in")
    assert list(runs.iterdir()) == []


def test_a_parent_where_no_file_can_be_created_is_refused_before_work(runs, tiny_llama_dir, monkeypatch):
    temporary_file = checkpoint.tempfile.TemporaryFile

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and os.path.samefile(dir, runs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return temporary_file(*args, dir=dir, **kwargs)

    monkeypatch.setattr(checkpoint.tempfile, "TemporaryFile", read_only)
    result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "-o", runs / "q")
    refused(result, "--output", "cannot create files in", "Read-only file system")
    assert list(runs.iterdir()) == []


def test_too_little_free_space_is_refused_before_work(runs, tiny_llama_dir, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "-o", runs / "q")
    refused(result, "--output", "MiB but", "has 1 MiB free")
    assert list(runs.iterdir()) == []


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),  # what a Python write raises
    checkpoint.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
])
def test_a_full_disk_while_writing_is_one_line_and_leaves_nothing(runs, tiny_llama_dir, monkeypatch, error):
    def half_then_full(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)
        raise error

    monkeypatch.setattr(checkpoint, "save_file", half_then_full)
    result = run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "-o", runs / "q")
    refused(result, "could not write --output", "No space left on device", "nothing was left behind")
    assert list(runs.iterdir()) == []


def test_a_full_disk_while_offloading_activations_is_one_line_and_leaves_nothing(runs, tiny_llama_dir, monkeypatch):
    from toolkit.engine.offload import DiskActivations

    def full(self, tensor):
        path = self.directory / "000000.pt"
        path.write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(DiskActivations, "append", full)
    result = run("quantize", "--model", tiny_llama_dir, "--method", "gptq", *TINY, *CALIBRATION,
                 "--offload-activations", "-o", runs / "q")
    refused(result, "could not write --output", "No space left on device", "000000.pt")
    assert list(runs.iterdir()) == []


# ---- item 8: every option checked before work, whatever the method --------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--method", "rtn", "--samples", "-5"], "--samples"),
    (["--method", "rtn", "--seq-len", "1"], "--seq-len"),
    (["--method", "rtn", "--eval", "--dataset", "/no/such/file.jsonl"], "--dataset /no/such/file.jsonl"),
    (["--method", "rtn", "--eval", "--eval-windows", "0"], "--eval-windows must be >= 1"),
    (["--method", "gptq", "--dataset", "/no/such/file.jsonl"], "does not exist"),
])
def test_bad_options_are_refused_before_any_work(runs, tiny_llama_dir, monkeypatch, args, message):
    from toolkit import quantize as verb

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(verb, "load_tokenizer", never)
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


# ---- item 9: permissions follow the umask ---------------------------------------------------------------------------


@pytest.fixture
def umask_022():
    before = os.umask(0o022)
    yield
    os.umask(before)


def modes(directory):
    """{relative path: permission bits} of ``directory`` and everything under it."""
    return {str(p.relative_to(directory)): p.stat().st_mode & 0o777 for p in [directory, *directory.rglob("*")]}


def test_a_checkpoint_and_its_conversion_follow_the_umask(runs, tiny_llama_dir, umask_022):
    out, converted = runs / "q", runs / "ct"
    assert run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "-o", out).exit_code == 0
    assert run("convert", "--model", out, "--format", "compressed-tensors", "-o", converted).exit_code == 0
    for directory in (out, converted):
        found = modes(directory)
        assert found.pop(".") == 0o755 and "model.safetensors" in found
        assert set(found.values()) == {0o644}, found


def test_a_streamed_checkpoint_follows_the_umask(runs, tiny_llama_dir, umask_022):
    out = runs / "q"
    assert run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "--stream", "-o", out).exit_code == 0
    found = modes(out)
    assert found.pop(".") == 0o755 and set(found.values()) == {0o644}, found


def test_a_heads_export_follows_the_umask(runs, umask_022):
    from toolkit.heads.medusa import MedusaConfig, MedusaHeads
    from toolkit.heads.medusa_export import export_medusa

    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=50, num_heads=2, num_layers=1))
    out = export_medusa(heads, runs / "heads", target="tiny", target_sha256=None)
    found = modes(out)
    assert found.pop(".") == 0o755 and "model.safetensors" in found
    assert set(found.values()) == {0o644}, found


def test_every_writer_removes_the_leftovers_of_killed_runs_for_its_output(tmp_path):
    """convert, heads exports and eval reports write through atomic_directory: a killed run's siblings for the same
    output go (with a warning naming them), a live run's and other outputs' stay."""
    output = tmp_path / "heads"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".heads.tmp-{int(dead.stdout)}-0123abcd"
    live = tmp_path / f".heads.tmp-{os.getpid()}-89abcdef"
    other = tmp_path / f".other.tmp-{int(dead.stdout)}-0123abcd"
    for path in (stale, live, other):
        path.mkdir()
    with pytest.warns(UserWarning, match=f"removed 1 leftover.*{stale.name}"):
        with atomic_directory(output) as staging:
            (staging / "x").write_text("x")
    assert not stale.exists() and live.exists() and other.exists() and (output / "x").read_text() == "x"
