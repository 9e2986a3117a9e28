"""What every command shares: the app, the error console, progress bars, the error exit."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

app = typer.Typer(help="Quantize LLMs to INT4, train draft heads, validate and push deployable checkpoints.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console(stderr=True)


class RichProgress:
    """Renders the engine's progress: one bar over decoder layers, the current step as its description."""

    def __init__(self, progress: Progress):
        self.progress, self.task = progress, None

    def start(self, total_layers):
        self.task = self.progress.add_task("quantizing layers", total=total_layers)

    def step(self, message):
        if self.task is None:
            console.log(message)
        else:
            self.progress.update(self.task, description=message)

    def layer_done(self, index, errors):
        worst_name, worst = max(errors.items(), key=lambda item: item[1], default=("-", 0.0))
        self.progress.console.log(f"layer {index}: {len(errors)} linears, largest error {worst:.4g} ({worst_name})")
        self.progress.update(self.task, advance=1, description=f"layer {index} done")


def progress_bar(disable: bool = False) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False, disable=disable)


def fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {err}")
    raise typer.Exit(2)


def user_errors() -> tuple[type[Exception], ...]:
    from toolkit.calibration import CalibrationError
    from toolkit.formats.checkpoint import OutputError
    from toolkit.models import ModelError
    from toolkit.quant.configs import ConfigError
    from toolkit.quant.finite import NonFiniteError
    from toolkit.runtime.load import CheckpointError

    return (ConfigError, ModelError, CalibrationError, CheckpointError, NonFiniteError, OutputError, FileExistsError,
            FileNotFoundError)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
