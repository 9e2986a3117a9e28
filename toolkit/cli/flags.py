"""Command-line flags derived from the config dataclasses' ``option`` fields (``toolkit.options``).

    @app.command()
    @flags.derived(QuantizeSettings, CalibrationSpec, methods=METHODS.values())
    def quantize(output: Path = typer.Option(...), **options): ...
    settings = flags.build(QuantizeSettings, options)

A field ``seq_len: int = option(512, "Tokens per calibration sequence.")`` becomes ``--seq-len`` with that default and
help; an enumerated field a ``Literal`` of its choices; a bool ``--name/--no-name`` (or its declared flag); ``tuple[str, ...]``
a repeatable flag, or comma-separated names when it has choices; ``tuple[int, ...]`` comma-separated integers. A
field's ``aliases`` (older spellings) are accepted beside its flag. Method options (fields of the quantization configs)
are the union over every method, each unset by default so that a method keeps its own default; a flag the chosen
method does not take is refused by ``make_config``.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Iterable
from typing import Literal, Optional

import typer

from toolkit.options import aliases_of, choices_of, flag_name, flag_of, help_of, option_fields


def _is_tuple_of(hint, element) -> bool:
    hint = _strip_optional(hint)
    return typing.get_origin(hint) is tuple and typing.get_args(hint)[0] is element


def _strip_optional(hint):
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def choice(values) -> type:
    """The annotation of a flag that takes one of ``values`` (typer checks it and lists them in --help)."""
    return Literal[tuple(str(v) for v in values if v is not None)]


def _comma_separated(hint, choices) -> bool:
    """A field given as one comma-separated flag: integers, or names among choices (``--categories prose,code``)."""
    return _is_tuple_of(hint, int) or (_is_tuple_of(hint, str) and bool(choices))


def _cli_type(hint, choices):
    """The annotation typer parses a field of type ``hint`` (one of ``choices`` when given) with."""
    if _comma_separated(hint, choices):
        return Optional[str]  # its elements are checked by the dataclass's check_choices
    if choices:
        return Optional[choice(choices)]
    if _is_tuple_of(hint, str):
        return list[str]
    return Optional[_strip_optional(hint)]


def _parameter(field: dataclasses.Field, hint, default, help_text: str) -> inspect.Parameter:
    declared = flag_of(field)
    names = [declared or flag_name(field.name), *aliases_of(field)]
    if _strip_optional(hint) is bool and not declared:
        names = [f"{flag_name(field.name)}/--no-{flag_name(field.name)[2:]}"]
    if _comma_separated(hint, choices_of(field)):
        default = ",".join(map(str, default)) if default not in (None, ...) else default
    elif _is_tuple_of(hint, str):
        default = list(default) if default is not None else []
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, annotation=_cli_type(hint, choices_of(field)),
                             default=typer.Option(default, *names, help=help_text))


def _field_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return ...


def parameters(*classes, methods: Iterable[type] = ()) -> list[inspect.Parameter]:
    """The flags of ``classes`` (each field with its own default) and of ``methods`` (the union of their fields,
    unset by default: the help says each method's own default)."""
    out, seen = [], set()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in option_fields(cls):
            out.append(_parameter(f, hints[f.name], _field_default(f), help_of(f)))
            seen.add(f.name)
    union: dict[str, list] = {}
    for cls in methods:
        hints = typing.get_type_hints(cls)
        for f in option_fields(cls):
            union.setdefault(f.name, []).append((cls, f, hints[f.name]))
    for name, declared in union.items():
        if name in seen:
            raise ValueError(f"option {name!r} is declared twice")
        defaults = {cls.method: _field_default(f) for cls, f, _ in declared}
        shown = next(iter(defaults.values())) if len(set(map(repr, defaults.values()))) == 1 else \
            "; ".join(f"{m} {d}" for m, d in defaults.items())
        cls, f, hint = declared[0]
        takes = "" if len(declared) == len(list(methods)) else f" ({', '.join(defaults)})"
        out.append(_parameter(f, hint, None, f"{help_of(f)}{takes} (default {shown})"))
    return out


def derived(*classes, methods: Iterable[type] = ()) -> Callable:
    """Decorate a command taking ``**options``: its signature gains the flags of ``classes`` and ``methods``."""
    methods = list(methods)

    def wrap(command: Callable) -> Callable:
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        command.__signature__ = signature.replace(parameters=own + parameters(*classes, methods=methods))
        return command

    return wrap


def value(cls, name: str, raw):
    """A flag's parsed value as field ``name`` of ``cls`` holds it (lists to tuples, comma lists to ints)."""
    hint = typing.get_type_hints(cls)[name]
    if raw is None:
        return None
    if _is_tuple_of(hint, str) and not isinstance(raw, str):
        return tuple(raw)
    if _is_tuple_of(hint, str):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if _is_tuple_of(hint, int):
        try:
            return tuple(int(part) for part in raw.split(","))
        except ValueError:
            raise typer.BadParameter(f"takes comma-separated integers such as 2,15,27, got {raw!r}",
                                     param_hint=flag_name(name)) from None
    return raw


def build(cls, options: dict):
    """An instance of ``cls`` from the command's parsed flags (its own fields only)."""
    return cls(**{f.name: value(cls, f.name, options[f.name]) for f in option_fields(cls) if f.name in options})


def method_options(methods: Iterable[type], options: dict) -> dict:
    """The method flags that were given (None: unset, the method keeps its default), as the configs hold them."""
    out = {}
    for cls in methods:
        for f in option_fields(cls):
            if f.name in options and options[f.name] not in (None, []) and f.name not in out:
                out[f.name] = value(cls, f.name, options[f.name])
    return out
