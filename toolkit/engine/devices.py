"""Where a verb computes: ``--device auto`` (CUDA where a GPU is present, else the CPU), ``cpu`` or ``cuda``.

The option is declared once here (``device_option``) and carried by the settings of each verb that computes on a
device, ``QuantizeSettings`` and ``HeadsJob``, so the flag and the recipe key of both derive from it; ``compound
decode`` takes the same choices. Under torchrun a CUDA device is the rank's own GPU (``LOCAL_RANK``).

``cpu`` is what every verb did before the option existed, and ``auto`` is ``cpu`` on a machine without CUDA, so a
CPU run writes the same bits either way. A GPU run computes the same method in another order of floating-point
operations; its checkpoint agrees with the CPU's within rounding, not bit for bit.
"""

from __future__ import annotations

import os

import torch

from toolkit.options import option
from toolkit.quant.configs import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def device_option():
    """The ``device`` field of a verb's settings: one declaration of its default, help and choices."""
    return option("auto", "Where the work runs: auto (CUDA when a GPU is present, else the CPU) | cpu | cuda.",
                  choices=DEVICES)


def local_cuda() -> torch.device:
    """This process's GPU: ``cuda:LOCAL_RANK`` (torchrun sets it; 0 outside torchrun)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def resolve(choice: str) -> torch.device:
    """The torch device of ``--device choice``; ``ConfigError`` for ``cuda`` without a CUDA device or an unknown
    choice."""
    if choice not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {choice!r}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch (torch.cuda.is_available() is False); "
                          "use --device cpu or auto")
    return local_cuda()
