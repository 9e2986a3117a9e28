"""``torchrun --nproc_per_node=1`` on one GPU: the reductions of ``toolkit.engine.distributed`` through an NCCL
process group (host tensors go through the rank's GPU), and ``compound quantize --device cuda`` under torchrun.

With one rank ``join`` stays the one-process identity (``WORLD_SIZE`` 1), so the rank program below opens the
NCCL group itself: what it checks is the reduction path every rank of a larger run takes. Two ranks cannot share
one GPU under NCCL, so a single-GPU machine checks no more than this.
"""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_models import GPU_REASON, LLAMA_TINY, random_llama, record, work_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_REASON)]


def _torchrun(program: list[str]) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
               "--master_port", str(port), *program]
    return subprocess.run(command, env=os.environ | {"OMP_NUM_THREADS": "4"}, capture_output=True, text=True,
                          timeout=300)


def test_nccl_reductions_under_torchrun(tmp_path):
    run = _torchrun([__file__, str(tmp_path)])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    backend, mean, count, amax = torch.load(tmp_path / "rank0.pt", weights_only=True)
    record("torchrun-nccl", {"backend": backend, "reductions": "mean_over_ranks, max_over_ranks (host tensors)"})
    assert backend == "nccl" and count == 5
    assert torch.equal(mean, torch.arange(4.0)) and torch.equal(amax, torch.tensor([3.0, -1.0]))


def test_quantize_under_torchrun(tmp_path):
    model = random_llama(work_dir(tmp_path) / "llama-tiny", LLAMA_TINY)
    compound = shutil.which("compound")
    assert compound, "the compound command is not on the PATH: pip install -e . first"
    run = _torchrun([compound, "quantize", "--model", str(model), "--method", "rtn", "--group-size",
                     "128", "--device", "cuda", "--output", str(tmp_path / "q")])
    record("torchrun-quantize", {"returncode": run.returncode, "tail": run.stderr[-300:]})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (tmp_path / "q" / "compound.json").is_file()


if __name__ == "__main__":  # the rank program of test_nccl_reductions_under_torchrun
    import torch.distributed as dist

    from toolkit.engine.distributed import max_over_ranks, mean_over_ranks

    dist.init_process_group("nccl")
    mean, count = mean_over_ranks(torch.arange(4.0), 5)  # host tensors: reduced through this rank's GPU
    amax = max_over_ranks(torch.tensor([3.0, -1.0]))
    torch.save((dist.get_backend(), mean, count, amax), Path(sys.argv[1]) / "rank0.pt")
    dist.destroy_process_group()
