"""Build and load compound's own C++ CPU code (one file each beside this one, described by a ``NativeBuild``), once
per machine: the int4 matmuls (``toolkit.runtime.cpu_int4.NATIVE``) and the float32 decode step
(``toolkit.runtime.decode_step``). ``python -m toolkit.runtime.doctor`` (``compound doctor``) builds them all and
says which run here and why.

``load(build)`` returns the compiled module, or None where it cannot run: a CPU without the file's instruction sets
(or not x86 Linux), or a machine where the build fails (no C++ compiler, no ninja); the reason is logged once and the
caller falls back to torch (the next int4 kernel, torch's own int4 op last; the decoder's torch forward).
``build_status(build)`` gives that reason as text.

The build goes through ``torch.utils.cpp_extension`` into ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), 15-20 s each the first time on a 2-core CPU, a hash check after. Its folder is named
by a hash of what the build reads (the source, the flags, torch and Python), so two checkouts with different sources
never share a build. A build is claimed by an ``owner`` file holding the builder's process id: torch's own lock
file carries no owner, and a build killed midway left it behind, on which every later load waited forever. Here a
claim whose process is dead is removed (with torch's lock) at once, and a live one is waited for with a message
naming it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

OWNER_FILE = "owner"  # in a build folder: "pid host" of the process building there
TORCH_LOCK_FILE = "lock"  # torch.utils.cpp_extension's lock in the same folder
BUILD_PATIENCE_S = 600.0  # the longest a load waits on another live process's build before giving up on it


class BuildBusy(RuntimeError):
    """Another process holds a build folder longer than we wait; the message says which and what to delete."""


@dataclass(frozen=True)
class NativeBuild:
    """One C++ file: its source beside this file, the /proc/cpuinfo flags it needs, its compiler flags (those that
    enable exactly these instruction sets, and any the file's numerics rely on) and the constants its Python side
    relies on (module attribute → value, checked at load)."""

    source: str
    cpu_flags: tuple[str, ...]
    compiler_flags: tuple[str, ...]
    constants: dict[str, int] = field(default_factory=dict, hash=False, compare=False)

    @property
    def path(self) -> Path:
        return Path(__file__).with_name(self.source)

    @property
    def cflags(self) -> list[str]:
        """Every compiler flag the build passes."""
        return ["-O3", *self.compiler_flags, "-fopenmp"]

    @property
    def module_name(self) -> str:
        """The compiled module's name and its folder in torch's extension cache: the file's stem and a hash of
        everything the build reads, so that a changed source (another checkout) builds apart."""
        import torch

        key = hashlib.sha256(self.path.read_bytes())
        for part in (*self.cflags, torch.__version__, sys.version):
            key.update(b"\0" + part.encode())
        return f"compound_{Path(self.source).stem}_{key.hexdigest()[:16]}"


def missing_cpu_flags(build: NativeBuild) -> list[str]:
    """The instruction sets ``build`` needs that this CPU lacks (all of them off x86-64 Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.is_file():
        return list(build.cpu_flags)
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), [])
    return [flag for flag in build.cpu_flags if flag not in flags]


def build_directory(build: NativeBuild) -> Path:
    """Where ``build`` compiles: ``TORCH_EXTENSIONS_DIR`` (else torch's default root) / its ``module_name``."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / build.module_name


def _build(build: NativeBuild) -> tuple[ModuleType | None, str]:
    """(the compiled module or None, why it does or does not run here)."""
    missing = missing_cpu_flags(build)
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}"
    from torch.utils.cpp_extension import load as compile_and_load

    directory = build_directory(build)
    log.info("loading compound's %s from %s (built once per machine, 15-20 s the first time)", build.source, directory)
    try:
        with claimed(directory):
            module = compile_and_load(name=build.module_name, sources=[str(build.path)], extra_cflags=build.cflags,
                                      build_directory=str(directory), verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure falls back to torch, with its reason
        lines = str(error).strip().splitlines()
        return None, f"the build failed: {lines[-1] if lines else type(error).__name__}"
    check_constants(build, module)
    return module, f"built in {directory}"


@functools.cache
def _load(build: NativeBuild) -> tuple[ModuleType | None, str]:
    """``_build`` once per process, a failure's reason logged."""
    module, reason = _build(build)
    if module is None:
        log.warning("compound's %s does not run here (%s); falling back to torch", build.source, reason)
    return module, reason


def load(build: NativeBuild) -> ModuleType | None:
    """The compiled module of ``build``, or None where it does not run here (the reason logged once)."""
    return _load(build)[0]


def build_status(build: NativeBuild) -> str:
    """Why ``build`` runs here or not (building it first if needed): 'built in …', 'this CPU lacks …' or
    'the build failed: …'."""
    return _load(build)[1]


def check_constants(build: NativeBuild, module: ModuleType) -> None:
    """Raise if the compiled module's exported constants differ from what its Python side assumes."""
    wrong = {name: getattr(module, name, None) for name, value in build.constants.items()
             if getattr(module, name, None) != value}
    if wrong:
        raise RuntimeError(f"compound's {build.source} exports {wrong}, but its Python side assumes "
                           f"{ {name: build.constants[name] for name in wrong} }: change the two together")


def _alive(owner_file: Path, owner: str) -> bool:
    """Whether the process recorded in ``owner_file`` ("pid host") may still run. An empty record is a claim being
    written, alive for a few seconds; one from another host cannot be checked and counts as alive."""
    pid, _, host = owner.partition(" ")
    if not owner:
        return time.time() - owner_file.stat().st_mtime < 5
    if not pid.isdigit():
        return False
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@contextlib.contextmanager
def claimed(directory: Path, patience_s: float = BUILD_PATIENCE_S, poll_s: float = 0.2):
    """Hold ``directory`` for one build: create its owner file (this process's id), waiting while a live process
    holds it and removing, with torch's lock, a claim whose process is dead. Raises ``BuildBusy`` after
    ``patience_s`` seconds of waiting on a live one."""
    directory.mkdir(parents=True, exist_ok=True)
    owner_file, torch_lock = directory / OWNER_FILE, directory / TORCH_LOCK_FILE
    me = f"{os.getpid()} {socket.gethostname()}"
    deadline, told = time.monotonic() + patience_s, None
    while True:
        try:
            descriptor = os.open(owner_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                owner = owner_file.read_text().strip()
                alive = _alive(owner_file, owner)
            except FileNotFoundError:
                continue  # released meanwhile
            if not alive:
                log.warning("removing the build lock of process %s in %s: that process is gone (a build killed "
                            "midway)", owner or "(unknown)", directory)
                owner_file.unlink(missing_ok=True)
                continue
            if owner != told:
                told = owner
                log.warning("waiting for process %s, which is building in %s (if no such build runs, delete %s)",
                            owner or "(starting)", directory, owner_file)
            if time.monotonic() > deadline:
                raise BuildBusy(f"process {owner} has held {owner_file} for over {patience_s:.0f} s; if it is not "
                                f"building, delete {owner_file} and {torch_lock}")
            time.sleep(poll_s)
            continue
        with os.fdopen(descriptor, "w") as handle:
            handle.write(me)
        break
    try:
        if torch_lock.exists():  # only a claim holder builds here, so torch's lock is a dead build's
            log.warning("removing torch's lock %s, left by a build killed midway", torch_lock)
            torch_lock.unlink(missing_ok=True)
        yield
    finally:
        owner_file.unlink(missing_ok=True)
