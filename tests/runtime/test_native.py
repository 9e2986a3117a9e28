"""toolkit.runtime.native and its doctor: build folders keyed by the sources, a dead build's lock cleared at once and
a live one named, the C++ constants checked against their Python side, and the doctor's account of this machine."""

import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from toolkit.runtime import cpu_int4, decode_step, doctor, native


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def sleeper():
    """A live process of ours, ended (by its id) after the test."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child
    child.kill()
    child.wait()


def test_a_dead_builds_lock_is_removed_within_seconds(tmp_path, caplog):
    """A build killed midway leaves its owner record and torch's lock: the next claim removes both at once."""
    (tmp_path / native.OWNER_FILE).write_text(f"{dead_pid()} {socket.gethostname()}")
    (tmp_path / native.TORCH_LOCK_FILE).touch()
    began = time.monotonic()
    with native.claimed(tmp_path, patience_s=30):
        assert (tmp_path / native.OWNER_FILE).read_text() == f"{os.getpid()} {socket.gethostname()}"
        assert not (tmp_path / native.TORCH_LOCK_FILE).exists()
    assert time.monotonic() - began < 10  # not the patience: the dead owner is seen at once
    assert not (tmp_path / native.OWNER_FILE).exists()
    assert "is gone" in caplog.text and "removing torch's lock" in caplog.text


def test_a_live_build_is_waited_for_and_named(tmp_path, caplog, sleeper):
    owner = f"{sleeper.pid} {socket.gethostname()}"
    (tmp_path / native.OWNER_FILE).write_text(owner)
    with pytest.raises(native.BuildBusy, match=str(tmp_path / native.OWNER_FILE)):
        with native.claimed(tmp_path, patience_s=0.5, poll_s=0.05):
            pass
    assert f"waiting for process {owner}" in caplog.text and str(tmp_path / native.OWNER_FILE) in caplog.text
    assert (tmp_path / native.OWNER_FILE).read_text() == owner  # a live owner's claim is left alone
    sleeper.kill()
    sleeper.wait()
    with native.claimed(tmp_path, patience_s=30):  # its process gone, the claim is ours
        pass


def test_a_load_after_a_killed_build_does_not_wait(tmp_path, monkeypatch):
    """The issue's case end to end, the compiler replaced by a stand-in: a stale owner and torch lock in the build
    folder, and the load still reaches the build (torch's lock gone, so torch would not wait on it)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = decode_step.BUILD
    folder = native.build_directory(build)
    folder.mkdir(parents=True)
    (folder / native.OWNER_FILE).write_text(f"{dead_pid()} {socket.gethostname()}")
    (folder / native.TORCH_LOCK_FILE).touch()
    seen = {}

    def stand_in(name, sources, extra_cflags, build_directory, verbose):
        seen.update(name=name, folder=build_directory, locked=(folder / native.TORCH_LOCK_FILE).exists())
        return SimpleNamespace(HEAD_STEP=8)

    monkeypatch.setattr(cpp_extension, "load", stand_in)
    module, reason = native._build(build)
    assert module is not None and reason == f"built in {folder}"
    assert seen == {"name": build.module_name, "folder": str(folder), "locked": False}
    assert not (folder / native.OWNER_FILE).exists()


def test_the_build_folder_is_keyed_by_the_source_and_flags(tmp_path, monkeypatch):
    source = tmp_path / "cpu_decode_step.cpp"
    monkeypatch.setattr(native.NativeBuild, "path", property(lambda build: source))
    build = native.NativeBuild("cpu_decode_step.cpp", ("avx2",), ("-mavx2",))
    source.write_text("int f() { return 1; }")
    first = build.module_name
    assert first.startswith("compound_cpu_decode_step_") and first.isidentifier()
    assert native.NativeBuild("cpu_decode_step.cpp", ("avx2",), ("-mavx2",)).module_name == first  # same source, same folder
    source.write_text("int f() { return 2; }")  # another checkout's source
    assert build.module_name != first
    assert native.NativeBuild("cpu_decode_step.cpp", ("avx2",), ("-mavx2", "-ffast-math")).module_name != build.module_name
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native.build_directory(build) == tmp_path / build.module_name


def test_constants_that_differ_from_the_python_side_are_refused():
    build = native.NativeBuild("cpu_int4_avx2.cpp", ("avx2",), ("-mavx2",), {"BLOCK_N": 8, "CHUNK_K": 8})
    native.check_constants(build, SimpleNamespace(BLOCK_N=8, CHUNK_K=8))
    with pytest.raises(RuntimeError, match="BLOCK_N"):
        native.check_constants(build, SimpleNamespace(BLOCK_N=16, CHUNK_K=8))
    with pytest.raises(RuntimeError, match="CHUNK_K"):
        native.check_constants(build, SimpleNamespace(BLOCK_N=8))


@pytest.mark.parametrize("name", list(cpu_int4.NATIVE))
def test_each_int4_kernel_exports_the_constants_its_packing_assumes(name):
    """The compiled module carries the block, chunk and code numbers (checked at load), and the pack function lays
    out exactly one block of that many columns per row of its output."""
    import torch

    kernel = cpu_int4.NATIVE[name]
    if native.missing_cpu_flags(kernel.build):
        pytest.skip(f"this CPU lacks {native.missing_cpu_flags(kernel.build)}")
    module = kernel.load()
    assert {key: getattr(module, key) for key in kernel.build.constants} == kernel.build.constants
    packed = kernel.pack(torch.zeros(2 * kernel.block, 4 * kernel.build.constants["CHUNK_K"], dtype=torch.uint8))
    assert packed.shape[:2] == (2, 4)


def test_the_doctor_says_what_runs_here_and_why(capsys):
    assert doctor.main() == 0  # every build this CPU allows built
    out = capsys.readouterr().out
    for serves, build in doctor.builds().items():
        line = next(line for line in out.splitlines() if line.startswith(f"{serves} ({build.source})"))
        missing = native.missing_cpu_flags(build)
        assert (f"does not run: this CPU lacks {', '.join(missing)}" if missing
                else f"runs: built in {native.build_directory(build)}") in line
    assert f"int4 linears on the CPU run: {cpu_int4.default_kernel()}" in out
    assert "avx2 " in out and "ninja: " in out


def test_the_doctor_reports_a_failed_build_and_exits_1(monkeypatch, capsys):
    from torch.utils import cpp_extension

    def no_ninja(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    native._load.cache_clear()
    try:
        runnable = [build for build in doctor.builds().values() if not native.missing_cpu_flags(build)]
        assert doctor.main() == (1 if runnable else 0)
    finally:
        native._load.cache_clear()  # later tests load the real modules again
    out = capsys.readouterr().out
    assert out.count("does not run: the build failed: Ninja is required to load C++ extensions") == len(runnable)
    assert "int4 linears on the CPU run: torch" in out and "decodes with: the torch forward" in out
