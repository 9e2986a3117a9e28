"""Every flag of ``compound quantize`` and ``compound train-heads`` is a recipe key of the same name, and back:
both are derived from the same config dataclasses (``toolkit.options``)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from conftest import refused as conftest_refused
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


WIDTH = 80


def run(*args, **env):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(WIDTH), **env})


def refused(result, *names: str) -> str:
    """A refusal by typer's own choice check (a usage error in a box)."""
    return conftest_refused(result, *names, usage=True)


def entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def _choices(command: str, flag: str) -> set[str] | None:
    """The values the CLI accepts for ``flag`` of ``command`` when it is a choice type, else None."""
    click_command = typer.main.get_command(app).commands[command]
    annotation = next(p for p in click_command.params if flag in p.opts).type_descriptor.annotation
    return set(typing.get_args(annotation)) if typing.get_origin(annotation) is typing.Literal else None


def _enumerated():
    """(command, flag, the values declared for it) for every enumerated option of the CLI."""
    from toolkit.cli.evaluate import HEADS_DTYPES
    from toolkit.decode.kv_cache import CACHE_DTYPES
    from toolkit.formats import FORMATS, gguf
    from toolkit.heads.options import TARGET_DTYPES
    from toolkit.quant.configs import METHODS
    from toolkit.quantize import QuantizeSettings

    settings = {f.name: f.metadata["compound.choices"] for f in QuantizeSettings.__dataclass_fields__.values()}
    return [("quantize", "--dtype", settings["dtype"]), ("quantize", "--format", settings["format"]),
            ("quantize", "--kv-cache", settings["kv_cache"]), ("quantize", "--method", tuple(METHODS)),
            ("train-heads", "--dtype", TARGET_DTYPES), ("convert", "--format", tuple(FORMATS)),
            ("convert", "--outtype", gguf.FLOAT_TYPES),
            ("decode", "--kv-cache", tuple(CACHE_DTYPES)), ("validate", "--dtype", HEADS_DTYPES)]


@pytest.mark.parametrize("command, flag, values", _enumerated(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_enumerated_option_is_a_choice_type(command, flag, values):
    assert _choices(command, flag) == {str(v) for v in values if v is not None}


@pytest.mark.parametrize("command", ["quantize", "train-heads"])
def test_dtype_bf16_is_refused_naming_the_valid_values(tmp_path, tiny_llama_dir, command):
    before = entries(tmp_path)
    result = run(command, "--model", tiny_llama_dir, "-o", tmp_path / "out", "--dtype", "bf16")
    refused(result, "--dtype", "'bf16'", "bfloat16", "float16", "float32")
    assert entries(tmp_path) == before  # no output, no work directory, no temporary directory


def test_recipe_dtype_takes_the_cli_values(tmp_path):
    from toolkit.recipes import RecipeError, load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: smollm2-135m\nquantize:\n  method: rtn\n  dtype: float32\n")
    assert load_recipe(recipe).quantize.settings.dtype == "float32"  # the CLI takes it, so does the recipe
    recipe.write_text("model: smollm2-135m\nquantize:\n  method: rtn\n  dtype: bf16\n")
    with pytest.raises(RecipeError, match=r"r.yaml:4: quantize.dtype: .*float16, bfloat16, float32, got 'bf16'"):
        load_recipe(recipe)


def test_decode_kv_cache_is_a_choice(tiny_llama_dir):
    result = run("decode", "--model", tiny_llama_dir, "--prompt", "Hi", "--kv-cache", "fp8")
    refused(result, "--kv-cache", "'fp8'", "float", "int8")


def test_convert_format_is_a_choice_and_writes_nothing(tmp_path):
    source = tmp_path / "ckpt"
    source.mkdir()
    before = entries(tmp_path)
    result = run("convert", "--model", source, "--format", "exl2", "-o", tmp_path / "out")
    refused(result, "--format", "'exl2'", "gptq", "awq", "compressed-tensors")
    assert entries(tmp_path) == before


def test_validate_heads_dtype_and_categories_are_checked_before_any_work(tmp_path):
    before = entries(tmp_path)
    heads = tmp_path / "heads"
    refused(run("validate", "--model", "smollm2-135m", "--heads", heads, "--dtype", "bf16"),
            "--dtype", "'bf16'", "float32", "bfloat16")
    text = refused(run("validate", "--model", "smollm2-135m", "--heads", heads, "--categories", "prose,poetry"),
                   "--categories", "poetry")
    assert "all, prose, code, non-english, structured" in text
    assert entries(tmp_path) == before
