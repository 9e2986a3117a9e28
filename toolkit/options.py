"""Options declared once, on the config dataclasses that use them; the CLI flags and the recipe keys are derived.

A config field made with ``option`` carries its help text (and, for an enumerated value, its choices) in the
field's metadata; ``toolkit.cli`` builds each verb's flags from those fields and ``toolkit.recipes`` builds each
section's keys from the same fields, so a flag and a recipe key are one thing by construction:

    @dataclass(frozen=True)
    class GPTQConfig(WeightQuantConfig):
        damp: float = option(0.01, "GPTQ: dampening relative to the mean Hessian diagonal.")

The flag is the field name with dashes (``flag_name``: ``--damp``; a bool is ``--name/--no-name``), the recipe key the
field name. ``check_choices`` is the one check of an enumerated value, for the CLI, the recipes and the Python API.
"""

from __future__ import annotations

import dataclasses
from typing import Any

HELP = "compound.help"
CHOICES = "compound.choices"
FLAG = "compound.flag"
ALIASES = "compound.aliases"
TRAIN_DTYPES = ("float32", "bfloat16")  # what a learner (heads, SignRound) computes in: bfloat16 is autocast


def option(default: Any = dataclasses.MISSING, help: str = "", *, choices: tuple | None = None,
           flag: str | None = None, aliases: tuple[str, ...] = (), default_factory: Any = dataclasses.MISSING,
           repr: bool = True) -> Any:
    """A dataclass field with its help text, optional choices, optional flag spelling (``"--sym/--asym"``) and
    optional older flag spellings still accepted (``aliases``: ``("--tag",)``)."""
    metadata = {HELP: help, CHOICES: choices, FLAG: flag, ALIASES: aliases}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata, repr=repr)


def flag_name(name: str) -> str:
    """The flag of field ``name``: ``--`` and the name with dashes (``seq_len`` → ``--seq-len``)."""
    return "--" + name.replace("_", "-")


def option_fields(cls) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` declared with ``option`` (the ones a user sets), in declaration order."""
    return [f for f in dataclasses.fields(cls) if HELP in f.metadata]


def help_of(f: dataclasses.Field) -> str:
    """The help text of an ``option`` field."""
    return f.metadata[HELP]


def choices_of(f: dataclasses.Field) -> tuple | None:
    """The allowed values of an enumerated ``option`` field, None for a free value."""
    return f.metadata[CHOICES]


def flag_of(f: dataclasses.Field) -> str | None:
    """An explicit flag spelling (``"--sym/--asym"``), None for the default ``--field-name``."""
    return f.metadata[FLAG]


def aliases_of(f: dataclasses.Field) -> tuple[str, ...]:
    """Older flag spellings of an ``option`` field that the CLI still accepts."""
    return f.metadata.get(ALIASES, ())


def flag_for(f: dataclasses.Field) -> str:
    """The flag a message names for field ``f``: its declared spelling (the first of ``--a/--b``) or ``flag_name``."""
    return (flag_of(f) or flag_name(f.name)).split("/")[0]


def check_choices(instance, error: type[Exception] = ValueError) -> None:
    """Refuse a value of an enumerated field of ``instance`` (each element, for a tuple) that is not among its
    choices, naming the flag; the error's ``option`` attribute holds the field name (a recipe names the key)."""
    for f in option_fields(type(instance)):
        choices, value = choices_of(f), getattr(instance, f.name)
        if choices is None or value is None:
            continue
        for element in value if isinstance(value, tuple) else (value,):
            if element not in choices:
                err = error(f"{flag_for(f)} must be one of {', '.join(str(c) for c in choices if c is not None)}, "
                            f"got {element!r}")
                err.option = f.name
                raise err


def check_at_least(instance, minimum, *names: str, error: type[Exception] = ValueError) -> None:
    """Refuse a field ``names`` of ``instance`` below ``minimum``, naming the flag; the error's ``option`` attribute
    holds the field name, as ``check_choices``'s does."""
    for name in names:
        if getattr(instance, name) < minimum:
            err = error(f"{flag_name(name)} must be >= {minimum}, got {getattr(instance, name)}")
            err.option = name
            raise err
