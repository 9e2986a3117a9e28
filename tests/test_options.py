"""Every flag of ``compound quantize`` and ``compound train-heads`` is a recipe key of the same name, and back:
both are derived from the same config dataclasses (``toolkit.options``)."""

from __future__ import annotations

import typer.main

from toolkit.cli import app
from toolkit.recipes.schema import SECTIONS

# Flags that act on one command's own run, not on what a recipe step computes: the recipe's top-level model and
# output, and what the command alone does (replace, evaluate after quantizing, a work directory, a dry run, its
# threads: `compound run --threads` sets a recipe's).
COMMAND_ONLY = {
    "quantize": {"model", "output", "overwrite", "evaluate", "eval_windows", "threads"},
    "train-heads": {"model", "output", "overwrite", "work_dir", "dry_run", "threads"},
}
SECTIONS_OF = {"quantize": ("calibration", "quantize"), "train-heads": ("heads",)}


def _flags(command: str) -> set[str]:
    click_command = typer.main.get_command(app).commands[command]
    return {p.name for p in click_command.params} - {"help"}


def _recipe_keys(section: str) -> set[str]:
    cls = SECTIONS[section]
    if hasattr(cls, "keys"):
        return set(cls.keys())
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)}


def test_quantize_flags_are_recipe_keys():
    flags = _flags("quantize") - COMMAND_ONLY["quantize"]
    keys = set().union(*(_recipe_keys(s) for s in SECTIONS_OF["quantize"]))
    assert flags == keys


def test_train_heads_flags_are_recipe_keys():
    flags = _flags("train-heads") - COMMAND_ONLY["train-heads"]
    assert flags == _recipe_keys("heads")


def test_command_only_flags_exist():
    for command, names in COMMAND_ONLY.items():
        assert names <= _flags(command), command
