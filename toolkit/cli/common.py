"""What every command shares: the app, the error console, progress bars, the start of a verb, the error exit."""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from toolkit.cli import flags
from toolkit.engine import threads
from toolkit.quant.configs import ConfigError

app = typer.Typer(help="Quantize LLMs to INT4, train draft heads, validate and push deployable checkpoints.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console(stderr=True, log_path=False)  # a log line says what happened, not which line of compound said it


class RichProgress:
    """Renders the engine's progress: one bar over decoder layers, the current step as its description, and per
    layer the largest error of its linears in ``measure`` (the method's error measure, ``toolkit.methods``)."""

    def __init__(self, progress: Progress, measure: str):
        self.progress, self.task, self.measure = progress, None, measure

    def start(self, total_layers):
        self.task = self.progress.add_task("quantizing layers", total=total_layers)

    def step(self, message):
        if self.task is None:
            console.log(message)
        else:
            self.progress.update(self.task, description=message)

    def layer_done(self, index, errors):
        worst_name, worst = max(errors.items(), key=lambda item: item[1], default=("-", 0.0))
        self.progress.console.log(f"layer {index}: largest {self.measure} {worst:.4g} in {worst_name}")
        self.progress.update(self.task, advance=1, description=f"layer {index} done")


def start(ctx: typer.Context, options: dict):
    """What every verb does before any torch work: choose and apply ``--threads`` (its first line says how many and
    why; a bad value exits 2), show Python warnings as one plain line each, and outside a terminal silence the tqdm
    bars of transformers and huggingface_hub (unless HF_HUB_DISABLE_PROGRESS_BARS is set: the user's choice). All
    three are restored when the command's context ``ctx`` closes. Returns the ``Threads``."""
    try:
        chosen = threads.choose(flags.build(threads.ThreadSettings, options).threads)
    except ConfigError as err:
        fail(err)
    before, formatter = torch.get_num_threads(), warnings.formatwarning
    threads.apply(chosen)
    warnings.formatwarning = _plain_warning
    restore = [lambda: torch.set_num_threads(before), lambda: setattr(warnings, "formatwarning", formatter)]
    if not console.is_terminal and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ:
        from transformers.utils import logging as transformers_logging

        if transformers_logging.is_progress_bar_enabled():  # also huggingface_hub's
            transformers_logging.disable_progress_bar()
            restore.append(transformers_logging.enable_progress_bar)
        # transformers' GGUF reader calls tqdm.auto directly ("Converting and de-quantizing GGUF tensors..."), which
        # that switch does not reach: its module-level name is replaced by a silenced one for the command.
        from transformers import modeling_gguf_pytorch_utils as gguf_reader

        bar = gguf_reader.tqdm
        gguf_reader.tqdm = functools.partial(bar, disable=True)
        restore.append(lambda: setattr(gguf_reader, "tqdm", bar))
    for undo in restore:
        ctx.call_on_close(undo)
    console.print(f"threads: {chosen}")
    return chosen


def _plain_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as one line in words: no source path, no source line."""
    return f"warning: {message}\n"


def progress_bar(disable: bool = False) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False, disable=disable)


def fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {err}")
    raise typer.Exit(2)


def user_errors() -> tuple[type[Exception], ...]:
    from toolkit.calibration import CalibrationError
    from toolkit.formats.checkpoint import OutputError
    from toolkit.formats.scheme import FormatError
    from toolkit.models import ModelError
    from toolkit.quant.configs import ConfigError
    from toolkit.quant.finite import NonFiniteError
    from toolkit.runtime.load import CheckpointError

    return (ConfigError, ModelError, CalibrationError, CheckpointError, NonFiniteError, OutputError, FormatError,
            FileExistsError, FileNotFoundError)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
