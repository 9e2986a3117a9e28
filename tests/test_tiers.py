"""The test tiers: every test runs under a timeout (pyproject's default; slow tests conftest's ``SLOW_TIMEOUT_S``),
and CI runs the fast tier before it sets up the peer venvs and runs the slow one."""

import re
import tomllib
from pathlib import Path

import pytest

import conftest

ROOT = Path(__file__).resolve().parents[1]


class FakeItem:
    """What ``pytest_collection_modifyitems`` reads and writes of a collected test: its markers."""

    def __init__(self, *markers):
        self.markers = list(markers)

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


def test_ci_runs_the_fast_tier_before_the_venvs_and_the_slow_tier():
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    steps = command.split(" && ")
    fast = steps.index('python3 -m pytest -q -n 2 --dist loadgroup -m "not slow"')
    slow = steps.index("python3 -m pytest -q -n 2 --dist loadgroup -m slow")
    venvs = [i for i, step in enumerate(steps) if re.match(r"bash scripts/setup_\w+\.sh", step)]
    assert venvs and fast < min(venvs) and max(venvs) < slow
