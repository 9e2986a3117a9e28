"""The test tiers: every test runs under a timeout (pyproject's default; slow tests conftest's ``SLOW_TIMEOUT_S``),
and CI runs the fast tier before it sets up the peer venvs and runs the slow one."""

import re
import tomllib
from pathlib import Path

import pytest

import conftest

ROOT = Path(__file__).resolve().parents[1]


class FakeItem:
    """What ``pytest_collection_modifyitems`` reads and writes of a collected test: its node id and markers."""

    def __init__(self, *markers, nodeid="tests/test_tiers.py::test_y"):
        self.markers, self.nodeid = list(markers), nodeid

    def get_closest_marker(self, name):
        return next((mark for mark in self.markers if mark.name == name), None)

    def add_marker(self, marker):
        self.markers.append(marker.mark)


def test_every_test_has_a_timeout_and_slow_ones_a_longer_one():
    default = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
    fast, slow, own = FakeItem(), FakeItem(pytest.mark.slow.mark), FakeItem(pytest.mark.slow.mark,
                                                                          pytest.mark.timeout(60).mark)
    conftest.pytest_collection_modifyitems([fast, slow, own])
    assert fast.get_closest_marker("timeout") is None  # pyproject's default applies
    assert slow.get_closest_marker("timeout").args == (conftest.SLOW_TIMEOUT_S,)
    assert own.get_closest_marker("timeout").args == (60,)  # a test's own limit is kept
    assert 0 < default < conftest.SLOW_TIMEOUT_S


def test_a_slow_modules_tests_share_one_xdist_group_unless_marked_with_another():
    slow, fast = pytest.mark.slow.mark, FakeItem(nodeid="tests/test_gemma3.py::test_fast")
    first, second = (FakeItem(slow, nodeid=f"tests/test_gemma3.py::test_{n}[x]") for n in "12")
    other, shared = FakeItem(slow, nodeid="tests/test_real_model.py::test_1"), FakeItem(
        slow, pytest.mark.xdist_group("checkpoints").mark, nodeid="tests/test_gemma3.py::test_3")
    conftest.pytest_collection_modifyitems([fast, first, second, other, shared])
    groups = [item.get_closest_marker("xdist_group") for item in (fast, first, second, other, shared)]
    assert groups[0] is None  # the fast tier is scheduled test by test
    assert groups[1].args == groups[2].args == ("tests/test_gemma3.py",)
    assert groups[3].args == ("tests/test_real_model.py",)
    assert [mark.args for mark in shared.markers if mark.name == "xdist_group"] == [("checkpoints",)]


def test_ci_runs_the_fast_tier_before_the_venvs_and_the_slow_tier():
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    steps = command.split(" && ")
    fast = steps.index('python3 -m pytest -q -n 2 --dist loadgroup -m "not slow"')
    slow = steps.index("python3 -m pytest -q -n 2 --dist loadgroup -m slow")
    venvs = [i for i, step in enumerate(steps) if re.match(r"bash scripts/setup_\w+\.sh", step)]
    assert venvs and fast < min(venvs) and max(venvs) < slow
