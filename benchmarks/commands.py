"""compound command lines built from the option dataclasses, so that no benchmark spells a flag by hand.

    job = HeadsJob(model=MODEL, output=out, head="eagle3", data=DataOptions(samples=256), work_dir=work)
    subprocess.run(train_heads_argv(job), check=True)

A field's flag is derived as the CLI derives it (``toolkit.cli.flags``), so a renamed option renames the benchmark's
flag too; only fields that differ from their dataclass's default are written (the CLI's default is that default).
"""

from __future__ import annotations

import dataclasses

from toolkit.options import flag_of, option_fields


def option_argv(*configs) -> list[str]:
    """The flags that set ``configs``' option fields (and those of the option dataclasses they hold) to their values,
    for the fields that differ from their defaults."""
    argv = []
    for config in configs:
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if dataclasses.is_dataclass(value) and option_fields(type(value)):
                argv += option_argv(value)
            elif f in option_fields(type(config)) and value != _default(f):
                argv += _flag(f.name, value, flag_of(f))
    return argv


def flag_argv(**settings) -> list[str]:
    """The flags of a verb's own options, by field name, each written even at its default (True: the flag alone;
    False or None: left out)."""
    return [word for name, value in settings.items() if value is not None and value is not False
            for word in _flag(name, value, None)]


def compound_argv(verb: str, *configs, **settings) -> list[str]:
    """``compound VERB`` with ``configs``' option flags, then ``settings`` (``flag_argv``)."""
    return ["compound", verb, *option_argv(*configs), *flag_argv(**settings)]


def quantize_argv(config, *parts, model, output, **settings) -> list[str]:
    """``compound quantize`` of ``model`` into ``output`` with a method config (``toolkit.quant.configs.make_config``)
    and the verb's other option dataclasses (``CalibrationSpec``, ``QuantizeSettings``, ``ThreadSettings``)."""
    return compound_argv("quantize", config, *parts, model=model, output=output, method=config.method,
                         overwrite=True, **settings)


def train_heads_argv(job) -> list[str]:
    """``compound train-heads`` for a ``toolkit.train_heads.HeadsJob`` (its head, options, output and work dir)."""
    return compound_argv("train-heads", job, model=job.model, output=job.output, work_dir=job.work_dir,
                         overwrite=job.overwrite)


def _flag(name: str, value, declared: str | None) -> list[str]:
    from toolkit.options import flag_name  # the CLI's derivation; imported here, so a script's --help stays light

    flag = declared or flag_name(name)  # a declared spelling ("--sym/--asym") or the CLI's derived one
    if isinstance(value, bool):
        on, _, off = flag.partition("/")
        return [on if value else off or "--no-" + on[2:]]
    if isinstance(value, tuple) and all(isinstance(item, int) for item in value):
        return [flag, ",".join(map(str, value))]  # tuple[int, ...]: comma-separated, as the CLI parses it
    if isinstance(value, tuple):
        return [item for element in value for item in (flag, str(element))]  # tuple[str, ...]: a repeated flag
    return [flag, str(value)]


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default
