import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from toolkit.formats.checkpoint import atomic_directory, verify_manifest, write_checkpoint


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
