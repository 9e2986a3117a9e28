"""Reading a recipe file: line-aware YAML, unknown keys with the nearest valid one, typed values."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from dataclasses import fields
from pathlib import Path

import yaml

from toolkit.options import flag_name
from toolkit.recipes.schema import RENAMED, SECTIONS, TOP_LEVEL, Recipe, RecipeError, SettingError


def load_recipe(path: Path | str) -> Recipe:
    """Read and validate a recipe; every problem is a ``RecipeError`` naming the file, line and key: unknown keys
    (with the nearest valid one), wrong types, values out of range, sections the recipe's steps cannot use."""
    path = Path(path)
    try:
        loader = yaml.SafeLoader(path.read_bytes().decode("utf-8"))
    except OSError as err:
        raise RecipeError(f"{path}: cannot read the recipe: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise RecipeError(f"{path}:{mark.line + 1 if mark else 1}: not valid YAML: {getattr(err, 'problem', err)}") \
            from None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}

    def fail(key: str, message: str, line: int | None = None) -> RecipeError:
        line = line or next((lines[k] for k in (key, key.rpartition(".")[0]) if k in lines), 1)
        return RecipeError(f"{path}:{line}: {key + ': ' if key else ''}{message}")

    if not isinstance(data, dict):
        raise fail("", "a recipe is a mapping with model, calibration, quantize, heads, evaluate, gates, push")
    _index_lines(root, "", lines, fail)
    _refuse_unknown(data, TOP_LEVEL, "", fail)
    if not isinstance(data.get("model"), str):
        raise fail("model", "is required: an alias (smollm2-135m, gemma3-270m), a local directory, a .gguf file or a Hub id")
    sections = {name: _section(cls, data[name], name, fail) for name, cls in SECTIONS.items() if name in data}
    output = data.get("output", f"out/{path.stem}")
    if not isinstance(output, str):
        raise fail("output", f"expected a directory path, got {output!r}")
    try:
        return Recipe(name=path.stem, model=data["model"], output=Path(output), source=path, **sections)
    except SettingError as err:
        raise fail(err.key, str(err)) from None


def _index_lines(node: yaml.Node, prefix: str, lines: dict[str, int], fail) -> None:
    """Record the line of every key path (``quantize.group_size``) and refuse a key given twice."""
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key in lines:
            raise fail(key, f"given twice (first on line {lines[key]})", line)
        lines[key] = line
        _index_lines(value_node, f"{key}.", lines, fail)


def _refuse_unknown(data: dict, known, prefix: str, fail) -> None:
    for key in data:
        if key not in known:
            near = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean {near[0]}?" if near else f"valid keys: {', '.join(known)}"
            raise fail(f"{prefix}{key}", f"unknown key; {hint}")


def _section(cls, data, name: str, fail):
    """Build section ``cls`` from its mapping, checking keys and types, then its own rules."""
    if not isinstance(data, dict):
        raise fail(name, f"expected a mapping of settings, got {data!r}")
    data = _renamed(data, name, fail)
    if hasattr(cls, "from_mapping"):  # a section built from several dataclasses' fields
        return _composite(cls, data, name, fail)
    specs = fields(cls)
    _refuse_unknown(data, [f.name for f in specs], f"{name}.", fail)
    hints = typing.get_type_hints(cls)
    values = {}
    for spec in specs:
        if spec.name not in data:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise fail(name, f"{spec.name} is required")
            continue
        try:
            values[spec.name] = _typed(data[spec.name], hints[spec.name])
        except TypeError as err:
            raise fail(f"{name}.{spec.name}", str(err)) from None
    try:
        return cls(**values)
    except SettingError as err:
        raise fail(f"{name}.{err.key}" if err.key else name, str(err)) from None
    except ValueError as err:  # an option's own check (check_choices, check_at_least) names its field
        if not hasattr(err, "option"):
            raise
        raise fail(f"{name}.{err.option}", str(err).removeprefix(flag_name(err.option) + " ")) from None


def _renamed(data: dict, name: str, fail) -> dict:
    """``data`` with the section's renamed keys (``RENAMED``) under their new names, each with a warning; a key given
    under both names is refused."""
    renamed = RENAMED.get(name, {})
    for old, new in renamed.items():
        if old in data and new in data:
            raise fail(f"{name}.{old}", f"renamed {new}, and {name}.{new} is given too; keep {new} only")
        if old in data:
            warnings.warn(str(fail(f"{name}.{old}", f"deprecated, renamed {new} (the verbs' option name); "
                                                    f"it is read as {name}.{new}")), FutureWarning, stacklevel=2)
    return {renamed.get(key, key): value for key, value in data.items()}


def _composite(cls, data: dict, name: str, fail):
    """Build a section whose keys come from several dataclasses (``cls.keys()``: key → declaring class)."""
    keys = cls.keys()
    _refuse_unknown(data, list(keys), f"{name}.", fail)
    values = {}
    for key, value in data.items():
        try:
            values[key] = _typed(value, typing.get_type_hints(keys[key])[key])
        except TypeError as err:
            raise fail(f"{name}.{key}", str(err)) from None
    try:
        return cls.from_mapping(values)
    except SettingError as err:
        raise fail(f"{name}.{err.key}" if err.key else name, str(err)) from None


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _typed(value, hint):
    """``value`` as type ``hint`` (int, float, bool, str, X | None, tuple[str | int, ...]); TypeError naming both."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is tuple:
        element = typing.get_args(hint)[0]
        if isinstance(value, str) or not isinstance(value, list) or \
                not all(isinstance(v, element) and not isinstance(v, bool) for v in value):
            raise TypeError(f"expected a list of {'strings' if element is str else 'integers'}, got {value!r}")
        return tuple(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    ok = isinstance(value, hint) and not (hint is not bool and isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise TypeError(f"expected {_TYPE_NAMES[hint]}, got {value!r} ({type(value).__name__})")
    return value
