"""Build and load compound's AVX512-BF16 int4 matmul (``cpu_int4_avx512.cpp``), once per machine.

``load()`` returns the compiled module, or None where it cannot run: a CPU without AVX512-BF16 (or not x86 Linux), or
a machine where the build fails (no C++ compiler, no ninja); the reason is logged once and ``toolkit.runtime.cpu_int4``
falls back to torch's own int4 op. The build goes through ``torch.utils.cpp_extension`` into its cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``): about 20 s the first time, a hash check after.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("cpu_int4_avx512.cpp")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")  # /proc/cpuinfo names of what COMPILER_FLAGS enable
COMPILER_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"]

log = logging.getLogger(__name__)


def missing_cpu_flags() -> list[str]:
    """The instruction sets the kernel needs that this CPU lacks (all of them off x86-64 Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.is_file():
        return list(CPU_FLAGS)
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), [])
    return [flag for flag in CPU_FLAGS if flag not in flags]


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernel module (``w4_mm``), or None with the reason logged once."""
    missing = missing_cpu_flags()
    if missing:
        log.info("CPU int4: this CPU lacks %s; using torch's int4 op", ", ".join(missing))
        return None
    from torch.utils.cpp_extension import load as build

    log.info("CPU int4: loading compound's AVX512-BF16 kernel (built once per machine, about 20 s the first time)")
    try:
        return build(name="compound_cpu_int4", sources=[str(SOURCE)], extra_cflags=COMPILER_FLAGS, verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure falls back to torch's op, with its reason
        log.warning("CPU int4: compound's AVX512-BF16 kernel did not build (%s); using torch's int4 op, about 1.4x "
                    "slower at batch 1", str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__)
        return None
