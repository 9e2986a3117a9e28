"""Options declared once, on the config dataclasses that use them; the CLI flags and the recipe keys are derived.

A config field made with ``option`` carries its help text (and, for an enumerated value, its choices) in the
field's metadata; ``toolkit.cli`` builds each verb's flags from those fields and ``toolkit.recipes`` builds each
section's keys from the same fields, so a flag and a recipe key are one thing by construction:

    @dataclass(frozen=True)
    class GPTQConfig(WeightQuantConfig):
        damp: float = option(0.01, "GPTQ: dampening relative to the mean Hessian diagonal.")

The flag is the field name with dashes (``--damp``; a bool is ``--name/--no-name``), the recipe key the field name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

HELP = "compound.help"
CHOICES = "compound.choices"
FLAG = "compound.flag"


def option(default: Any = dataclasses.MISSING, help: str = "", *, choices: tuple | None = None,
           flag: str | None = None, default_factory: Any = dataclasses.MISSING, repr: bool = True) -> Any:
    """A dataclass field with its help text, optional choices and optional flag spelling (``"--sym/--asym"``)."""
    metadata = {HELP: help, CHOICES: choices, FLAG: flag}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata, repr=repr)


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


def check_choices(instance, error: type[Exception] = ValueError) -> None:
    """Refuse a value of an enumerated field of ``instance`` that is not among its choices, naming the flag."""
    for f in option_fields(type(instance)):
        choices, value = choices_of(f), getattr(instance, f.name)
        if choices is not None and value not in choices and value is not None:
            flag = (flag_of(f) or "--" + f.name.replace("_", "-")).split("/")[0]
            raise error(f"{flag} must be one of {', '.join(str(c) for c in choices if c is not None)}, got {value!r}")
