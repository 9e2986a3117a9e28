"""``scripts/gpu_check.sh`` on a machine without a GPU: its plan (``--dry-run``) names every ``tests/gpu`` test, keeps
within the 8-minute budget and fits what travels to a device machine in 64 MiB; without CUDA it says so and exits 0."""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _bash(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env=env or os.environ)


def test_dry_run_prints_the_plan_and_the_size_that_travels():
    run = _bash("--dry-run")
    assert run.returncode == 0, run.stdout + run.stderr
    for check in _driver().CHECKS:
        assert check.name in run.stdout and all(test in run.stdout for test in check.tests)
    assert "of 64 MiB: fits" in run.stdout and "working tree that travels" in run.stdout


def test_the_plan_runs_every_gpu_test_and_names_only_real_ones():
    driver = _driver()
    named = {test for check in driver.CHECKS for test in check.tests}
    defined = {}
    for path in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        defined[path.relative_to(ROOT).as_posix()] = {f.name for f in tree.body
                                                      if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
    for test in named:
        file, _, function = test.partition("::")
        assert file in defined and (not function or function in defined[file]), f"{test} does not exist"
    missed = [f"{file}::{name}" for file, names in defined.items() for name in names
              if file not in named and f"{file}::{name}" not in named]
    assert not missed, f"gpu tests the script never runs: {missed}"
    assert all(check.timeout_s <= driver.BUDGET_S <= 8 * 60 for check in driver.CHECKS)


def test_a_tree_over_the_limit_is_refused(monkeypatch, capsys):
    driver = _driver()
    monkeypatch.setattr(driver, "TRAVEL_LIMIT", 1024)
    assert driver.dry_run() == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_the_missing_dependencies_are_read_from_pyproject():
    driver = _driver()
    declared = driver.declared_dependencies()
    assert {"torch", "transformers", "gguf", "datasets", "triton"} <= set(declared)
    assert set(driver.missing_dependencies()) <= set(declared)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the script on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    run = _bash(env=os.environ | {"OUT": str(tmp_path / "report")})
    assert run.returncode == 0 and "no CUDA device" in run.stdout
    assert not (tmp_path / "report").exists()


def test_each_check_runs_alone_and_the_report_is_always_written(tmp_path, monkeypatch):
    """A check that fails and one that hangs past its timeout cost their own time; the next check still runs, and
    the report holds every status and the numbers the tests recorded."""
    driver = _driver()
    tests = tmp_path / "checks"
    tests.mkdir()
    (tests / "test_fake.py").write_text(
        "import sys, time\nsys.path.insert(0, %r)\nfrom gpu_models import record\n\n"
        "def test_records():\n    record('fake', {'value': 1.5, 'rows': {'a': {'x': 1}, 'b': {'x': 2}}})\n\n"
        "def test_fails():\n    assert False\n\n"
        "def test_hangs():\n    time.sleep(60)\n" % str(ROOT / "tests" / "gpu"))
    node = str(tests / "test_fake.py")
    monkeypatch.setattr(driver, "CHECKS", (
        driver.Check("hangs", (f"{node}::test_hangs",), 5, "sleeps past its timeout"),
        driver.Check("fails", (f"{node}::test_fails",), 60, "fails"),
        driver.Check("records", (f"{node}::test_records",), 60, "records numbers"),
    ))
    monkeypatch.setattr(driver, "install", lambda report: True)  # nothing is installed by a test
    assert driver.run_checks(tmp_path / "out") == 1
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| hangs | timed out after 5 s |" in report and "| fails | failed (exit 1) |" in report
    assert "| records | passed |" in report and "- value: 1.5" in report and "| b | 2 |" in report
    assert {"gpu_check.md", "gpu_check.json", "gpu_check.log"} == {p.name for p in (tmp_path / "out").iterdir()}
