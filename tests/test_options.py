"""Every verb's flags come from its option dataclasses (``toolkit.options``), and every recipe section's keys are the
fields of the same dataclasses: a flag and a recipe key are one thing by construction, with one name and one default."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from conftest import refused as conftest_refused
from toolkit.cli import app
from toolkit.convert import ConvertOptions
from toolkit.decode.options import DecodeOptions
from toolkit.engine.threads import ThreadSettings
from toolkit.evaluate.options import EvalHeadsOptions, EvalOptions, HeadsCheckOptions, HeldOut
from toolkit.hub_options import PushOptions
from toolkit.options import check_choices, flag_for, option, option_fields
from toolkit.quant.configs import METHODS, MethodChoice
from toolkit.quantize import CalibrationSpec, QuantizeSettings
from toolkit.recipes.schema import SECTIONS
from toolkit.train_heads import HeadsJob
from toolkit.validate import ValidateOptions

# Each verb: the dataclasses its flags are derived from, and the flags that are the command's own inputs rather than
# settings (what it reads and writes: a recipe's top-level model and output, its steps' paths; quantize --eval).
VERBS = {
    "quantize": ((MethodChoice, QuantizeSettings, CalibrationSpec, *METHODS.values(), ThreadSettings),
                 {"model", "output", "overwrite", "evaluate", "eval_windows"}),
    "train-heads": ((HeadsJob, *HeadsJob.parts().values(), ThreadSettings),
                    {"model", "output", "overwrite", "work_dir", "dry_run"}),
    "eval": ((HeldOut, EvalOptions, EvalHeadsOptions, ThreadSettings),
             {"model", "base", "heads", "output", "overwrite"}),
    "validate": ((HeldOut, ValidateOptions, HeadsCheckOptions, ThreadSettings), {"model", "heads", "json_out"}),
    "decode": ((DecodeOptions, ThreadSettings), {"model", "prompt"}),
    "convert": ((ConvertOptions, ThreadSettings), {"model", "output", "overwrite"}),
    "push": ((PushOptions,), {"directory", "results"}),
    "doctor": ((), set()),  # no options: it reports on this machine
}
# Each recipe section: the dataclasses its keys are, and keys only a recipe has.
SECTION_SOURCES = {
    "calibration": ((CalibrationSpec,), set()),
    "quantize": ((MethodChoice, QuantizeSettings, *METHODS.values()), set()),
    "heads": ((HeadsJob, *HeadsJob.parts().values()), set()),
    "evaluate": ((EvalOptions, HeadsCheckOptions), set()),
    "push": ((PushOptions,), {"heads_repo", "enabled"}),
}


def _flags(command: str) -> dict[str, object]:
    """The parameters of ``command`` by name, without --help."""
    click_command = typer.main.get_command(app).commands[command]
    return {p.name: p for p in click_command.params if p.name != "help"}


def _fields(*classes) -> set[str]:
    return {f.name for cls in classes for f in option_fields(cls)}


def _recipe_keys(section: str) -> set[str]:
    cls = SECTIONS[section]
    return set(cls.keys()) if hasattr(cls, "keys") else {f.name for f in dataclasses.fields(cls)}


def test_every_verb_is_covered():
    assert set(VERBS) == set(typer.main.get_command(app).commands) - {"run"}  # run's flags are the recipe's


@pytest.mark.parametrize("verb", VERBS)
def test_a_verbs_flags_are_its_dataclass_fields(verb):
    classes, own = VERBS[verb]
    assert set(_flags(verb)) - own == _fields(*classes)


@pytest.mark.parametrize("verb", [v for v in VERBS if v != "quantize"])  # quantize's method options: flags.py
def test_a_flags_default_and_spelling_are_its_fields(verb):
    flags = _flags(verb)
    for cls in VERBS[verb][0]:
        for f in option_fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            if isinstance(default, tuple):  # a repeatable flag's list, or a comma-separated one
                default = list(default) if flags[f.name].multiple else ",".join(map(str, default))
            assert flags[f.name].default in (default, ...) or flags[f.name].required, (verb, f.name)
            assert flag_for(f) in flags[f.name].opts, (verb, f.name)


@pytest.mark.parametrize("section", SECTION_SOURCES)
def test_a_recipe_sections_keys_are_the_same_fields(section):
    classes, own = SECTION_SOURCES[section]
    assert _recipe_keys(section) - own == _fields(*classes)


def test_recipe_and_cli_share_each_default():
    """A recipe section's default is the verb's: the section *is* the dataclass, so `windows` is eval's 8."""
    evaluate, push = SECTIONS["evaluate"](), SECTIONS["push"](repo="me/model")
    for cls in (EvalOptions, HeadsCheckOptions):
        assert dataclasses.asdict(cls()) == {k: getattr(evaluate, k) for k in _fields(cls)}
    assert dataclasses.asdict(PushOptions("me/model")) == {k: getattr(push, k) for k in _fields(PushOptions)}
    assert evaluate.windows == EvalOptions().windows == 8


# Names that several option classes declare with different defaults, and why they may: each is one meaning whose
# default is its verb's (or method's) job. Any other name two classes share must share its default too.
SHARED_NAMES_WITH_OWN_DEFAULTS = {
    "act_order": "each method's own column order, declared once in its config",
    "format": "quantize resolves auto; convert has no default (the target layout is its input)",
    "samples": "conversations drawn from a dataset: 128 to calibrate, 1000 to train heads",
    "lr": "a learning rate: SignRound's signed step (None: 1/iters) and the heads' AdamW peak",
    "windows": "held-out windows: validate's quick check (2 × 64 tokens) against eval's measurement (8 × 512)",
    "seq_len": "held-out windows: validate's quick check (2 × 64 tokens) against eval's measurement (8 × 512)",
}


def _defaults_by_name() -> dict[str, dict[str, set[str]]]:
    """Every option field name → its default (repr) → the classes that declare it with that default."""
    found: dict[str, dict[str, set[str]]] = {}
    for classes, _ in VERBS.values():
        for cls in classes:
            for f in option_fields(cls):
                default = None if f.default is dataclasses.MISSING else f.default
                found.setdefault(f.name, {}).setdefault(repr(default), set()).add(cls.__name__)
    return found


def test_one_name_per_setting_across_verbs():
    """A setting several verbs take has one name and one default (the tokens a verb decodes per prompt); a name with
    several defaults is one of the listed few, each one meaning with its verb's default. The three dtypes are three
    names: quantize --dtype (the checkpoint's), train-heads --target-dtype, validate --decode-dtype."""
    assert DecodeOptions().max_new_tokens == HeadsCheckOptions().max_new_tokens == EvalHeadsOptions().head_tokens
    several = {name for name, defaults in _defaults_by_name().items() if len(defaults) > 1}
    assert several == set(SHARED_NAMES_WITH_OWN_DEFAULTS), several ^ set(SHARED_NAMES_WITH_OWN_DEFAULTS)
    renamed = {"new_tokens", "repo_id", "heads_repo_id"}  # the recipe keys that spelled a verb's setting differently
    assert not renamed & set().union(*(_recipe_keys(s) for s in SECTIONS if s != "gates"))


@pytest.mark.parametrize("cls, values, message", [
    (MethodChoice, {"method": "hqq"}, "--method must be one of rtn, gptq, awq, awq+gptq, signround, got 'hqq'"),
    (ConvertOptions, {"format": "exl2"}, "--format must be one of gptq, awq, compressed-tensors, gguf, got 'exl2'"),
    (DecodeOptions, {"kv_cache_dtype": "fp8"}, "--kv-cache-dtype must be one of float, int8, int8-static, got 'fp8'"),
    (HeadsCheckOptions, {"categories": ("prose", "poetry")}, "--categories must be one of all, prose, code, "
                                                              "non-english, structured, got 'poetry'"),
    (HeadsCheckOptions, {"decode_dtype": "float16"}, "--decode-dtype must be one of bfloat16, float32, got 'float16'"),
    (EvalOptions, {"windows": 0}, "--windows must be >= 1, got 0"),
])
def test_options_refuse_a_value_naming_the_flag(cls, values, message):
    with pytest.raises(ValueError) as err:
        cls(**values)
    assert str(err.value) == message and err.value.option == next(iter(values))


def test_check_choices_checks_each_element_of_a_tuple():
    @dataclasses.dataclass(frozen=True)
    class Sets:
        names: tuple[str, ...] = option(("a",), "Names.", choices=("a", "b"))

    check_choices(Sets(("a", "b")))
    with pytest.raises(ValueError, match="--names must be one of a, b, got 'c'"):
        check_choices(Sets(("a", "c")))


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
    from toolkit.decode.kv_cache import CACHE_DTYPES
    from toolkit.evaluate.options import HEADS_DTYPES
    from toolkit.formats import FORMATS, gguf
    from toolkit.models import FLOAT_DTYPES
    from toolkit.quant.configs import METHODS
    from toolkit.quantize import QuantizeSettings

    settings = {f.name: f.metadata["compound.choices"] for f in QuantizeSettings.__dataclass_fields__.values()}
    return [("quantize", "--dtype", settings["dtype"]), ("quantize", "--format", settings["format"]),
            ("quantize", "--kv-cache", settings["kv_cache"]), ("quantize", "--method", tuple(METHODS)),
            ("train-heads", "--target-dtype", FLOAT_DTYPES), ("convert", "--format", tuple(FORMATS)),
            ("convert", "--outtype", gguf.FLOAT_TYPES),
            ("decode", "--kv-cache-dtype", tuple(CACHE_DTYPES)), ("validate", "--decode-dtype", HEADS_DTYPES)]


@pytest.mark.parametrize("command, flag, values", _enumerated(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_enumerated_option_is_a_choice_type(command, flag, values):
    assert _choices(command, flag) == {str(v) for v in values if v is not None}


@pytest.mark.parametrize("command, flag", [("quantize", "--dtype"), ("train-heads", "--target-dtype")])
def test_dtype_bf16_is_refused_naming_the_valid_values(tmp_path, tiny_llama_dir, command, flag):
    before = entries(tmp_path)
    result = run(command, "--model", tiny_llama_dir, "-o", tmp_path / "out", flag, "bf16")
    refused(result, flag, "'bf16'", "bfloat16", "float16", "float32")
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
    result = run("decode", "--model", tiny_llama_dir, "--prompt", "Hi", "--kv-cache-dtype", "fp8")
    refused(result, "--kv-cache-dtype", "'fp8'", "float", "int8")


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
    refused(run("validate", "--model", "smollm2-135m", "--heads", heads, "--decode-dtype", "bf16"),
            "--decode-dtype", "'bf16'", "float32", "bfloat16")
    text = refused(run("validate", "--model", "smollm2-135m", "--heads", heads, "--categories", "prose,poetry"),
                   "--categories", "poetry")
    assert "all, prose, code, non-english, structured" in text
    assert entries(tmp_path) == before
