"""Data parallelism across the processes ``torchrun`` starts: the process group and the reductions that turn
per-rank calibration statistics into the statistics of the whole batch (each rank's device: ``devices``).

Nothing here schedules work: torchrun starts one process per device, ``torch.distributed`` (gloo on CPU, NCCL on
GPUs) moves the tensors. Outside torchrun (``WORLD_SIZE`` unset or 1) every function is the one-process identity.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from toolkit.engine.devices import local_cuda


def join(device: torch.device | None = None, timeout: timedelta = timedelta(hours=12)) -> tuple[int, int]:
    """(rank, world size): joins the process group under torchrun (once), else (0, 1): NCCL when the ranks compute
    on CUDA (``device``; None: wherever a GPU is present), gloo on the CPU. The long default timeout lets one rank
    write a checkpoint or build data for hours while the others wait at a barrier."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    if not dist.is_initialized():
        on_cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
        dist.init_process_group("nccl" if on_cuda else "gloo", timeout=timeout)
        atexit.register(_leave)
    return dist.get_rank(), dist.get_world_size()


def _leave() -> None:
    """Tear the group down before the interpreter exits, all ranks together: a gloo group left to the C++
    destructors, or torn down while another rank still talks to it, aborts the process ("terminate called without
    an active exception"). The exit barrier is bounded, so a rank that failed alone does not hang the others."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        except RuntimeError:
            pass
    dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (nothing outside torchrun)."""
    if dist.is_initialized():
        dist.barrier()


def mean_over_ranks(mean: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
    """Combine running means: each rank's ``mean`` over its ``count`` samples → (the mean over all ranks' samples,
    in place, and their total count)."""
    if not dist.is_initialized():
        return mean, count
    total = torch.tensor([float(count)], dtype=torch.float64)
    _all_reduce(total, dist.ReduceOp.SUM)
    _all_reduce(mean.mul_(count), dist.ReduceOp.SUM)
    return mean.div_(total.item()), int(total.item())


def max_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over ranks, in place."""
    if dist.is_initialized():
        _all_reduce(tensor, dist.ReduceOp.MAX)
    return tensor


def _all_reduce(tensor: torch.Tensor, op) -> None:
    """All-reduce in place; through this rank's GPU when the backend (NCCL) cannot reduce host tensors."""
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        on_device = tensor.to(local_cuda())
        dist.all_reduce(on_device, op=op)
        tensor.copy_(on_device)
    else:
        dist.all_reduce(tensor, op=op)
