"""``compound train-heads``: options derived from the job's option dataclasses, results and serving flags."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from toolkit.cli import flags
from toolkit.cli.common import app, console, fail, start, user_errors
from toolkit.cli.render import fit
from toolkit.engine.threads import ThreadSettings
from toolkit.train_heads import HeadsJob


@app.command("train-heads")
@flags.derived(HeadsJob, *HeadsJob.parts().values(), ThreadSettings)
def train_heads(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", help="Target: alias, local directory, .gguf, Hub id, or a compound checkpoint (train against the model you serve)."),
    output: Path = typer.Option(..., "--output", "-o", help="Head directory to create."),
    work_dir: Optional[Path] = typer.Option(None, help="Where data, hidden states and training checkpoints go (default: OUTPUT.work); rerun to resume."),
    overwrite: bool = typer.Option(False, help="Replace an existing output directory."),
    dry_run: bool = typer.Option(False, help="Show one rendered example with its trained tokens highlighted, then stop."),
    **options,
):
    """Train draft heads on the target's own hidden states and export them for vLLM (runs under torchrun too)."""
    from toolkit.train_heads import train_heads as run_train_heads

    threads = start(ctx, options)
    try:
        parts = {name: flags.build(cls, options) for name, cls in HeadsJob.parts().items()}
        job = HeadsJob(model=model, output=output, head=options["head"], device=options["device"], **parts,
                       work_dir=work_dir, overwrite=overwrite)
        result = run_train_heads(job, console, dry_run=dry_run)
    except (*user_errors(), ValueError) as err:
        fail(err)
    if result.output is None:
        return
    table = result_table(f"compound train-heads: {job.kind.describe(job.head_options)} for {model}", result)
    table.add_row("threads", str(threads))
    out = Console()
    out.print(fit(table))
    for line in job.kind.serving_lines(result.output, job.head_options):
        out.print(line, soft_wrap=True, markup=False, highlight=False)


def result_table(title: str, result) -> Table:
    """What a ``HeadsResult`` holds: where the heads went, the data, the best step and its metrics, the time."""
    table = Table(title=title)
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("output", str(result.output))
    table.add_row("examples / tokens / trained tokens", f"{result.examples} / {result.tokens:,} / {result.trained_tokens:,}")
    table.add_row("best step", str(result.best_step))
    for key, value in result.best_metrics.items():
        table.add_row(key, f"{value:.3f}")
    for key, value in result.seconds.items():
        table.add_row(f"seconds, {key.replace('_', ' ')}", f"{value:.0f}")
    return table
