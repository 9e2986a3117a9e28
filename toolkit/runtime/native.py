"""Build and load compound's own C++ CPU code (one file each beside this one, described by a ``NativeBuild``), once
per machine: the int4 matmuls (``toolkit.runtime.cpu_int4.NATIVE``) and the float32 decode step
(``toolkit.runtime.decode_step``).

``load(build)`` returns the compiled module, or None where it cannot run: a CPU without the file's instruction sets
(or not x86 Linux), or a machine where the build fails (no C++ compiler, no ninja); the reason is logged once and the
caller falls back to torch (the next int4 kernel, torch's own int4 op last; the decoder's torch forward). The build
goes through ``torch.utils.cpp_extension`` into its cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``): 15-20 s each the first time on a 2-core CPU, a hash check after.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NativeBuild:
    """One C++ file: its source beside this file, the /proc/cpuinfo flags it needs and its compiler flags (those that
    enable exactly these instruction sets, and any the file's numerics rely on)."""

    source: str
    cpu_flags: tuple[str, ...]
    compiler_flags: tuple[str, ...]

    @property
    def path(self) -> Path:
        return Path(__file__).with_name(self.source)

    @property
    def module_name(self) -> str:
        """The compiled module's name (and its folder in torch's extension cache)."""
        return f"compound_{Path(self.source).stem}"


def missing_cpu_flags(build: NativeBuild) -> list[str]:
    """The instruction sets ``build`` needs that this CPU lacks (all of them off x86-64 Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.is_file():
        return list(build.cpu_flags)
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), [])
    return [flag for flag in build.cpu_flags if flag not in flags]


@functools.cache
def load(build: NativeBuild) -> ModuleType | None:
    """The compiled module of ``build`` (its ``w4_mm``), or None with the reason logged once."""
    missing = missing_cpu_flags(build)
    if missing:
        log.info("this CPU lacks %s; compound's %s does not run here", ", ".join(missing), build.source)
        return None
    from torch.utils.cpp_extension import load as compile_and_load

    log.info("loading compound's %s (built once per machine, 15-20 s the first time)", build.source)
    try:
        return compile_and_load(name=build.module_name, sources=[str(build.path)],
                                extra_cflags=["-O3", *build.compiler_flags, "-fopenmp"], verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure falls back to torch, with its reason
        log.warning("compound's %s did not build (%s); falling back to torch", build.source,
                    str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__)
        return None
