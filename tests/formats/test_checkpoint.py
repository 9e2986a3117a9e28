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
from toolkit.formats.checkpoint import OutputError, atomic_directory, verify_manifest, write_checkpoint


def test_atomic_directory_appears_only_when_complete(tmp_path):
    out = tmp_path / "ckpt"
    with atomic_directory(out) as staging:
        (staging / "a.txt").write_text("x")
        assert not out.exists()
    assert (out / "a.txt").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_or_ctrl_c_leaves_nothing(tmp_path, error):
    out = tmp_path / "ckpt"
    with pytest.raises(error):
        with atomic_directory(out) as staging:
            (staging / "half.safetensors").write_bytes(b"123")
            raise error()
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_overwrite_and_is_replaced_whole(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match="--overwrite"):
        with atomic_directory(out):
            pass
    with atomic_directory(out, overwrite=True) as staging:
        (staging / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_killed_process_leaves_no_output_dir(tmp_path):
    out = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from toolkit.formats.checkpoint import atomic_directory
        with atomic_directory(Path({str(out)!r})) as staging:
            (staging / "model.safetensors").write_bytes(b"0" * 1000)
            print("writing", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # only a hidden staging directory may remain, never a half checkpoint at `out`
    assert all(p.name.startswith(".ckpt.tmp-") for p in tmp_path.iterdir())


def test_write_checkpoint_contents_and_manifest(tmp_path, smol_tokenizer):
    from conftest import tiny_model
    from safetensors.torch import load_file

    model = tiny_model("llama", vocab=49152)
    packed = {"model.layers.0.mlp.down_proj": {"qweight": torch.zeros(16, 64, dtype=torch.int32)}}
    out = write_checkpoint(tmp_path / "c", model, smol_tokenizer, packed, {"quant_method": "gptq", "bits": 4},
                           {"method": "rtn"})
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "quantize_config.json", "model.safetensors", "compound.json", "tokenizer.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["bits"] == 4 and config["torch_dtype"] == "float16"
    tensors = load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.down_proj.weight" not in tensors
    assert tensors["model.layers.0.mlp.down_proj.qweight"].dtype == torch.int32
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float16
    assert verify_manifest(out) == []
    with open(out / "config.json", "a") as f:
        f.write(" ")
    assert verify_manifest(out) == ["config.json"]


def _packed_tiny_llama():
    """A tiny Llama quantized in memory (RTN W4 g32) and its linears packed as GPTQ."""
    from conftest import tiny_model

    from toolkit.engine.loop import quantize_layers
    from toolkit.formats import gptq
    from toolkit.methods import driver_for
    from toolkit.quant.configs import RTNConfig

    model, config, packed = tiny_model("llama"), RTNConfig(bits=4, group_size=32), {}
    quantize_layers(model, config, driver_for(config), None, lambda name, q: packed.update({name: gptq.pack(q)}))
    return model, gptq.quantization_config(config), packed


def test_sharded_checkpoint_matches_the_single_file_and_loads(tmp_path, smol_tokenizer):
    from safetensors.torch import load_file

    from toolkit.formats.checkpoint import WEIGHTS_INDEX, read_tensors
    from toolkit.runtime.load import load_quantized

    model, quant, packed = _packed_tiny_llama()
    single = write_checkpoint(tmp_path / "single", model, smol_tokenizer, packed, quant, {"method": "rtn"})
    sharded = write_checkpoint(tmp_path / "sharded", model, smol_tokenizer, packed, quant, {"method": "rtn"},
                               max_shard_size=1_000_000)  # the fp16 embedding alone is 6.3 MB
    assert "model.safetensors" in {p.name for p in single.iterdir()} and not (single / WEIGHTS_INDEX).exists()
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    n = len(shards)
    assert n >= 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]

    index = json.loads((sharded / WEIGHTS_INDEX).read_text())
    reference = load_file(single / "model.safetensors")
    assert set(index["weight_map"]) == set(reference) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in reference.values())
    for shard in shards:  # every tensor sits in the shard the index names
        assert all(index["weight_map"][name] == shard for name in load_file(sharded / shard))
    tensors = read_tensors(sharded)
    assert tensors.keys() == reference.keys()
    assert all(tensors[k].dtype == reference[k].dtype and torch.equal(tensors[k], reference[k]) for k in reference)

    manifest = json.loads((sharded / "compound.json").read_text())
    assert set(shards) | {WEIGHTS_INDEX} <= set(manifest["files"]) and verify_manifest(sharded) == []
    tokens = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = load_quantized(single)[0](tokens).logits, load_quantized(sharded)[0](tokens).logits
    assert torch.equal(expected, got)


def test_transformers_reads_the_shard_index(tmp_path, smol_tokenizer):
    from conftest import tiny_model
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    out = write_checkpoint(tmp_path / "float", model, smol_tokenizer, {}, None, {}, torch.float16,
                           max_shard_size="1MB")
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16)
    expected = {k: v.half() for k, v in model.state_dict().items()}
    got = loaded.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


runner = CliRunner()


TINY = ["--group-size", "32"]


CALIBRATION = ["--samples", "4", "--seq-len", "32"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


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
    assert left == [".q.activations", ".q.layers", ".q.tmp"] and not out.exists()  # .layers: the finished layers
    result = run(*args)  # resumes from the saved layers, removes the killed run's leftovers
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
