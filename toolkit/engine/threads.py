"""How many threads torch computes on: ``--threads auto`` (every verb's default) or a count.

torch's default is one thread per core. When anything else keeps a core busy, its OpenMP threads spin at barriers
waiting for the thread the kernel has descheduled: batch-1 decoding on this 2-core machine ran 8-10× slower at the
default than on one thread with another job beside it (issue #28). ``auto`` therefore takes the cores this process may run on, less the cores the other processes keep busy now:

    threads = clamp(round(cores − others' busy cores), 1, cores)
    others' busy cores = max(0, busy cores over a 0.5 s sample of /proc/stat − this process's CPU in that sample)

cores: ``os.sched_getaffinity`` (what a container or ``taskset`` leaves this process), else ``os.cpu_count()``.
The sample sees the machine as it is when the verb starts; the 1-minute load average (the fallback where
/proc/stat cannot be read) still counts for a minute a job that has ended, such as the ``pip install`` chained before
the README's main job, which made ``auto`` pick one thread on a quiet machine. An ``OMP_NUM_THREADS`` in the
environment is the user's (or torchrun's) choice, and ``auto`` keeps it.
"""

from __future__ import annotations

import math
import os
import time
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


SAMPLE_SECONDS = 0.5


def _busy_and_total() -> tuple[int, int]:
    """Busy and total jiffies of every core so far (the ``cpu`` line of /proc/stat: idle and iowait are not busy)."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def others_busy_cores(seconds: float = SAMPLE_SECONDS) -> tuple[float, str]:
    """The cores other processes keep busy, and how that was measured: a ``seconds`` sample of /proc/stat less this
    process's own CPU in it; the 1-minute load average less this process's share where /proc/stat is unreadable."""
    try:
        busy0, total0 = _busy_and_total()
        own0 = sum(os.times()[:2])
        time.sleep(seconds)
        busy1, total1 = _busy_and_total()
        own1 = sum(os.times()[:2])
    except (OSError, ValueError, IndexError):
        times = os.times()
        return max(0.0, os.getloadavg()[0] - (times.user + times.system) / 60), "1-minute load average"
    elapsed_cores = (total1 - total0) / max(1, os.cpu_count() or 1)  # jiffies per core in the sample
    busy = (busy1 - busy0) / elapsed_cores if elapsed_cores else 0.0
    return max(0.0, busy - (own1 - own0) / seconds), f"sampled over {seconds:g} s"


def auto_threads(cores: int, others_busy: float) -> int:
    """``clamp(round(cores − others_busy), 1, cores)``: the cores other processes leave free."""
    return max(1, min(cores, math.floor(cores - max(0.0, others_busy) + 0.5)))


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
    cores = available_cores()
    others, measured = others_busy_cores()
    return Threads(auto_threads(cores, others), f"auto: {cores} cores, {others:.1f} busy with other processes "
                                                f"({measured})")


def apply(threads: Threads) -> None:
    """Run torch's intra-op work on ``threads.count`` threads (and inter-op work, while torch still allows it)."""
    import torch

    torch.set_num_threads(threads.count)
    try:
        torch.set_num_interop_threads(threads.count)
    except RuntimeError:  # only settable before the first inter-op parallel work of the process
        pass
