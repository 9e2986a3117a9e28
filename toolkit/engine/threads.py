"""How many threads torch computes on: ``--threads auto`` (every verb's default) or a count.

torch's default is one thread per core. When anything else keeps a core busy, its OpenMP threads spin at barriers
waiting for the thread the kernel has descheduled: batch-1 decoding on this 2-core machine ran 8-10× slower at the
default than on one thread with another job beside it (issue #28). ``auto`` therefore takes the cores this process
may run on, less the load the other processes put on them:

    threads = clamp(round(cores − others' load), 1, cores)
    others' load = max(0, 1-minute load average − this process's own share of it)

cores: ``os.sched_getaffinity`` (what a container or ``taskset`` leaves this process), else ``os.cpu_count()``.
This process's share: its CPU seconds so far over 60 s, which is what a young process adds to the exponentially
weighted 1-minute average (the verbs choose their threads at start, seconds after ``import torch``). An
``OMP_NUM_THREADS`` in the environment is the user's (or torchrun's) choice, and ``auto`` keeps it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from toolkit.options import option
from toolkit.quant.configs import ConfigError

AUTO = "auto"


@dataclass(frozen=True)
class ThreadSettings:
    """The one thread option every verb takes (a command-line flag only: it changes speed, never a result)."""

    threads: str = option(AUTO, "Torch compute threads: auto (the cores this process may use less the load of other "
                                "processes, at least 1; OMP_NUM_THREADS when set) or a count.")


@dataclass(frozen=True)
class Threads:
    """The thread count chosen and why (``auto: ...`` or the flag)."""

    count: int
    reason: str

    def __str__(self) -> str:
        return f"{self.count} thread{'s' if self.count != 1 else ''} ({self.reason})"


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def own_load() -> float:
    """This process's share of the 1-minute load average: its CPU seconds over 60 s (see the module docstring)."""
    times = os.times()
    return (times.user + times.system) / 60


def auto_threads(cores: int, load_average: float, own: float) -> int:
    """``clamp(round(cores − max(0, load_average − own)), 1, cores)``: the cores other processes leave free."""
    others = max(0.0, load_average - own)
    return max(1, min(cores, math.floor(cores - others + 0.5)))


def choose(value: str, environ: Mapping[str, str] = os.environ) -> Threads:
    """The ``Threads`` for ``--threads value``; ``ConfigError`` for anything but ``auto`` or a positive integer."""
    if value != AUTO:
        try:
            count = int(value)
        except ValueError:
            count = 0
        if count < 1:
            raise ConfigError(f"--threads must be auto or a positive integer, got {value!r}")
        return Threads(count, "--threads")
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return Threads(int(omp), f"auto: OMP_NUM_THREADS={omp}")
    cores, (load, _, _), own = available_cores(), os.getloadavg(), own_load()
    count = auto_threads(cores, load, own)
    return Threads(count, f"auto: {cores} cores, load {max(0.0, load - own):.1f} from other processes")


def apply(threads: Threads) -> None:
    """Run torch's intra-op work on ``threads.count`` threads (and inter-op work, while torch still allows it)."""
    import torch

    torch.set_num_threads(threads.count)
    try:
        torch.set_num_interop_threads(threads.count)
    except RuntimeError:  # only settable before the first inter-op parallel work of the process
        pass
