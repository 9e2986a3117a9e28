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
