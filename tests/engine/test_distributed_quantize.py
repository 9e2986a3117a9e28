"""``torchrun ... compound quantize``: data-parallel GPTQ (each rank runs every world-th calibration sequence, the
Hessians are averaged over ranks). The reduction gives the one-process Hessian to float rounding; the checkpoint is
then the one-process checkpoint up to what such rounding moves in GPTQ (as much as changing --batch-size in one
process moves it: one code in a few hundred); rank 0 alone writes it; what cannot be split is refused."""

import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from toolkit.engine.distributed import join, max_over_ranks, mean_over_ranks
from toolkit.formats.checkpoint import read_tensors
from toolkit.formats.gptq import unpack
from toolkit.quant.configs import AWQConfig, AWQGPTQConfig, ConfigError, RTNConfig, make_config
from toolkit.quant.gptq import HessianAccumulator
from toolkit.quantize import CalibrationSpec, _check_data_parallel

ARGS = ["--method", "gptq", "--sym", "--bits", "4", "--group-size", "32", "--samples", "6", "--seq-len", "48",
        "--batch-size", "2"]


def _torchrun(program: list[str], ranks: int = 2) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
               "127.0.0.1", "--master_port", str(port), *program]
    return subprocess.run(command, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)


def _token_chunks() -> list[torch.Tensor]:
    """Activations of unequal token counts, one chunk per rank of a 3-rank run."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, 24, generator=g) @ torch.randn(24, 24, generator=g) for n in (50, 7, 130)]


@pytest.mark.slow  # several processes or minutes of retries: the second tier
def test_hessians_and_absmax_reduce_to_the_whole_batchs(tmp_path):
    run = _torchrun([__file__, str(tmp_path)], ranks=3)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    whole = HessianAccumulator(24)
    whole.add(torch.cat(_token_chunks()))
    for rank in range(3):
        H, tokens, amax = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert tokens == 187
        torch.testing.assert_close(H, whole.H, rtol=1e-5, atol=1e-6)
        assert torch.equal(amax, torch.stack([c.abs().amax(0) for c in _token_chunks()]).amax(0))


@pytest.mark.slow  # several processes or minutes of retries: the second tier
@pytest.mark.parametrize("stream", [False, True])
def test_two_ranks_write_the_one_process_checkpoint(tiny_llama_dir, tmp_path, stream):
    mode = ["--stream"] if stream else []
    one = subprocess.run(["compound", "quantize", "--model", str(tiny_llama_dir), "-o", str(tmp_path / "one"),
                          *ARGS, *mode], env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert one.returncode == 0, one.stdout[-2000:]
    run = _torchrun([shutil.which("compound"), "quantize", "--model", str(tiny_llama_dir), "-o", str(tmp_path / "two"),
                     *ARGS, *mode])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.count("compound quantize: gptq") == 1  # rank 0 reports

    expected, got = read_tensors(tmp_path / "one"), read_tensors(tmp_path / "two")
    assert sorted(got) == sorted(expected)
    linears = sorted(name.removesuffix(".qweight") for name in expected if name.endswith(".qweight"))
    assert linears
    same_codes = total = 0
    for name in linears:
        a = unpack({k.removeprefix(name + "."): v for k, v in expected.items() if k.startswith(name + ".")}, 4, 32)
        b = unpack({k.removeprefix(name + "."): v for k, v in got.items() if k.startswith(name + ".")}, 4, 32)
        same_codes += int((a.codes == b.codes).sum())
        total += a.codes.numel()
        relative = float((b.dequantize() - a.dequantize()).norm() / a.dequantize().norm())
        assert relative < 0.1, f"{name}: weights {relative:.4f} apart"
    assert same_codes / total > 0.97, f"{same_codes / total:.4f} of the codes agree"
    assert all(torch.equal(got[n], expected[n]) for n in expected if not n.startswith("model.layers."))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no rank left a staging directory


def test_what_cannot_be_split_is_refused():
    with pytest.raises(ConfigError, match="awq"):
        _check_data_parallel(make_config("awq", bits=4, group_size=32), CalibrationSpec(samples=8), 2)
    with pytest.raises(ConfigError, match="at least 4 --samples"):
        _check_data_parallel(make_config("gptq", bits=4, group_size=32), CalibrationSpec(samples=3), 4)
    _check_data_parallel(make_config("rtn", bits=4, group_size=32), CalibrationSpec(samples=1), 4)


def test_data_parallel_refusal_follows_the_capability():
    @dataclass(frozen=True)
    class SerialConfig(RTNConfig):  # a method declared here: no other file names it
        method = "serial"
        data_parallel = False

    @dataclass(frozen=True)
    class SplitAWQConfig(AWQConfig):
        data_parallel = True

    for config in (SerialConfig(), AWQGPTQConfig()):
        with pytest.raises(ConfigError, match="under torchrun compound quantizes with rtn or gptq; "
                                             rf"{re.escape(config.method)}'s search runs in one process"):
            _check_data_parallel(config, CalibrationSpec(samples=8), 2)
    _check_data_parallel(SplitAWQConfig(), CalibrationSpec(samples=8), 2)


if __name__ == "__main__":  # one rank of test_hessians_and_absmax_reduce_to_the_whole_batchs
    rank, world = join()
    chunk = _token_chunks()[rank]
    accumulator = HessianAccumulator(24)
    for part in chunk.split(16):  # a running mean, as the GPTQ driver keeps it
        accumulator.add(part)
    H, tokens = mean_over_ranks(accumulator.H, accumulator.tokens)
    torch.save((H, tokens, max_over_ranks(chunk.abs().amax(0))), Path(sys.argv[1]) / f"rank{rank}.pt")
