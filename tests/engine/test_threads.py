"""``--threads``: the auto rule against a fake load average, an explicit count, a bad value refused (exit 2), and the
option on every verb, printed first and recorded in the summary."""

import pytest
import torch
import typer.main
from conftest import refused
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.engine import threads
from toolkit.quant.configs import ConfigError

VERBS = ("quantize", "convert", "decode", "eval", "validate", "train-heads", "run")


@pytest.mark.parametrize("cores,others,expected", [
    (2, 0.0, 2),  # a quiet machine: every core
    (2, 4.5, 1),  # other jobs keep both cores busy: one thread, never zero
    (8, 3.4, 5),  # round(8 − 3.4)
    (8, 3.6, 4),  # round(8 − 3.6)
    (4, -0.2, 4),  # a sample below zero (our own CPU counted twice): capped at the cores
])
def test_auto_takes_the_cores_other_processes_leave(cores, others, expected):
    assert threads.auto_threads(cores, others) == expected


def test_auto_reads_affinity_and_what_others_keep_busy(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 6)
    monkeypatch.setattr(threads, "others_busy_cores", lambda: (2.0, "sampled over 0.5 s"))
    chosen = threads.choose("auto", environ={})
    assert chosen.count == 4 and chosen.reason == "auto: 6 cores, 2.0 busy with other processes (sampled over 0.5 s)"


def test_a_busy_core_beside_us_is_seen():
    """A real /proc/stat sample: a spinning child process counts as (most of) one busy core."""
    import multiprocessing
    import time as clock

    stop = multiprocessing.Event()
    spinner = multiprocessing.Process(target=_spin, args=(stop,))
    spinner.start()
    try:
        clock.sleep(0.3)
        beside, how = threads.others_busy_cores(seconds=0.5)
    finally:
        stop.set()
        spinner.join()
    assert how == "sampled over 0.5 s" and beside >= 0.6


def _spin(stop):
    while not stop.is_set():
        pass


def test_auto_keeps_omp_num_threads_and_a_count_is_taken_as_given():
    assert threads.choose("auto", environ={"OMP_NUM_THREADS": "3"}) == threads.Threads(3, "auto: OMP_NUM_THREADS=3")
    assert threads.choose("5", environ={"OMP_NUM_THREADS": "3"}) == threads.Threads(5, "--threads")
    assert str(threads.Threads(1, "--threads")) == "1 thread (--threads)"


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5", ""])
def test_a_bad_count_is_refused(value):
    with pytest.raises(ConfigError, match="--threads must be auto or a positive integer"):
        threads.choose(value)


def test_apply_sets_torch_threads():
    before = torch.get_num_threads()
    try:
        threads.apply(threads.Threads(2, "--threads"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_every_verb_takes_threads_with_default_auto():
    commands = typer.main.get_command(app).commands
    for verb in VERBS:
        option = next((p for p in commands[verb].params if p.name == "threads"), None)
        assert option is not None and option.default == "auto", verb


def test_bad_threads_exit_2_before_any_work(tiny_llama_dir):
    result = CliRunner().invoke(app, ["decode", "--model", str(tiny_llama_dir), "--prompt", "Hi", "--threads", "zero"])
    refused(result, "--threads must be auto or a positive integer, got 'zero'")
    assert "threads:" not in result.output


def test_the_count_is_the_first_line_and_in_the_summary_then_restored(tiny_llama_dir):
    before = torch.get_num_threads()
    result = CliRunner().invoke(app, ["decode", "--model", str(tiny_llama_dir), "--prompt", "Hi",
                                      "--max-new-tokens", "2", "--threads", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "threads: 2 threads (--threads)"
    cells = [line.replace("│", " ").split() for line in result.output.splitlines()]
    assert ["threads", "2", "threads", "(--threads)"] in cells  # the summary table's row
    assert torch.get_num_threads() == before  # the command's setting ends with it
