"""Which of compound's CPU kernels this machine runs, and why: ``python -m toolkit.runtime.doctor`` (also
``compound doctor``) builds every C++ file (``native``), then prints the CPU flags each needs, each build's outcome
with its reason, and what the int4 linears and the float32 decoder will run. Exits 1 when a build the CPU allows
failed (a missing compiler or ninja), so a script can check a machine with it."""

from __future__ import annotations

import logging
import platform
import shutil
import sys
from dataclasses import dataclass

from toolkit.runtime import cpu_int4, decode_step, native


@dataclass(frozen=True)
class Finding:
    """One of compound's native builds on this machine: what it serves, its file, whether it runs, and why."""

    serves: str
    source: str
    runs: bool
    reason: str


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                        platform.processor() or platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def builds() -> dict[str, native.NativeBuild]:
    """Every C++ file compound builds, by what it serves."""
    return {**{f"int4 kernel {name}": kernel.build for name, kernel in cpu_int4.NATIVE.items()},
            "float32 decode step": decode_step.BUILD}


def findings() -> list[Finding]:
    """Build every file (or find it built) and say for each whether it runs here and why."""
    return [Finding(serves, build.source, native.load(build) is not None, native.build_status(build))
            for serves, build in builds().items()]


def report() -> tuple[list[str], bool]:
    """(the doctor's lines, whether every build the CPU allows built)."""
    found = findings()
    wanted = sorted({flag for build in builds().values() for flag in build.cpu_flags})
    lacking = {flag for build in builds().values() for flag in native.missing_cpu_flags(build)}
    ninja = shutil.which("ninja")
    lines = [f"CPU: {_cpu_name()} ({platform.system()} {platform.machine()})",
             "instruction sets compound's kernels use: "
             + ", ".join(f"{flag} {'no' if flag in lacking else 'yes'}" for flag in wanted),
             f"ninja: {ninja or 'not found (every build fails without it: pip install ninja)'}",
             f"C++ compiler: {shutil.which('c++') or 'not found (every build fails without one)'}"]
    for finding in found:
        lines.append(f"{finding.serves} ({finding.source}): {'runs' if finding.runs else 'does not run'}: "
                     f"{finding.reason}")
    step = "compound's C++ decode step" if decode_step.load() is not None else "the torch forward"
    lines += [f"int4 linears on the CPU run: {cpu_int4.default_kernel()} (the first of "
              f"{', '.join(cpu_int4.KERNELS)} that runs here)",
              f"a float32 model decodes with: {step} (a head width that is a multiple of "
              f"{getattr(decode_step.load(), 'HEAD_STEP', '?')} and a float32 KV cache; else the torch forward)"]
    healthy = all(finding.runs or native.missing_cpu_flags(build) for finding, build in zip(found, builds().values()))
    return lines, healthy


def main() -> int:
    """Print the report; 0 when every build the CPU allows built, else 1."""
    lines, healthy = report()
    print("\n".join(lines))
    return 0 if healthy else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # a failed build's warning, as one plain line
    sys.exit(main())
