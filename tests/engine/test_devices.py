"""``--device``: auto picks CUDA where torch sees a GPU and the CPU elsewhere, cpu forces the CPU, cuda without a GPU
is refused with the flag to change; quantize, train-heads and decode take it, and a recipe's key is the same."""

import hashlib

import pytest
import torch
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.engine import devices
from toolkit.quant.configs import ConfigError, RTNConfig
from toolkit.quantize import QuantizeSettings, quantize
from toolkit.train_heads import HeadsJob


def test_auto_is_cuda_where_present_and_the_cpu_elsewhere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")  # torchrun's rank on this node: its own GPU
    assert devices.resolve("auto") == torch.device("cuda", 3)
    assert devices.resolve("cuda") == torch.device("cuda", 3)
    assert devices.resolve("cpu") == torch.device("cpu")


def test_cuda_without_a_gpu_and_unknown_devices_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device cuda: no CUDA device .* use --device cpu or auto"):
        devices.resolve("cuda")
    with pytest.raises(ConfigError, match="--device must be one of auto, cpu, cuda, got 'tpu'"):
        devices.resolve("tpu")
    with pytest.raises(ConfigError, match="--device must be one of auto, cpu, cuda"):
        QuantizeSettings(device="tpu")
    with pytest.raises(ValueError, match="--device must be one of auto, cpu, cuda"):
        HeadsJob(model="m", output="o", device="tpu")


def _digest(directory) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(directory.glob("*.safetensors")))).hexdigest()


def test_forcing_the_cpu_writes_the_same_checkpoint_as_auto_without_a_gpu(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = RTNConfig(group_size=32)
    auto = quantize(str(tiny_llama_dir), config, tmp_path / "auto", settings=QuantizeSettings()).output
    cpu = quantize(str(tiny_llama_dir), config, tmp_path / "cpu", settings=QuantizeSettings(device="cpu")).output
    assert _digest(auto) == _digest(cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("verb", [
    ["decode", "--prompt", "Hi"],
    ["quantize", "--method", "rtn", "--output", "{tmp}/q"],
    ["train-heads", "--output", "{tmp}/h", "--max-len", "64"],
])
def test_the_verbs_refuse_cuda_without_a_gpu(tmp_path, tiny_llama_dir, verb):
    args = [a.replace("{tmp}", str(tmp_path)) for a in verb]
    result = CliRunner().invoke(app, [*args, "--model", str(tiny_llama_dir), "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert "--device cuda: no CUDA device" in result.output and not any(tmp_path.iterdir())


def test_the_flag_lists_its_choices(tiny_llama_dir):
    result = CliRunner().invoke(app, ["decode", "--model", str(tiny_llama_dir), "--prompt", "Hi", "--device", "tpu"])
    assert result.exit_code == 2 and "'tpu' is not one of" in result.output
