"""The ``compound`` command line: parse options into a config, call one verb, render the result with Rich."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(help="Quantize LLMs to INT4, train draft heads, validate and push deployable checkpoints.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console(stderr=True)

DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


class _RichProgress:
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


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def _fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {err}")
    raise typer.Exit(2)


def _user_errors() -> tuple[type[Exception], ...]:
    from toolkit.calibration import CalibrationError
    from toolkit.engine import ActivationError
    from toolkit.models import ModelError
    from toolkit.quant.configs import ConfigError
    from toolkit.runtime.load import CheckpointError

    return (ConfigError, ModelError, CalibrationError, CheckpointError, ActivationError, FileExistsError,
            FileNotFoundError)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _is_checkpoint(spec: str) -> bool:
    path = Path(spec)
    return (path / "config.json").is_file() and "quantization_config" in (path / "config.json").read_text()


def _load_for_eval(spec: str):
    """A quantized compound checkpoint through the runtime loader, anything else as a float model."""
    from toolkit.models import load_model, load_tokenizer
    from toolkit.runtime.load import load_quantized

    if _is_checkpoint(spec):
        return load_quantized(spec)
    return load_model(spec), load_tokenizer(spec)


def _measure_perplexity(spec: str, dataset: str, windows: int, seq_len: int):
    from toolkit.calibration import eval_windows
    from toolkit.evaluate.perplexity import perplexity

    model, tokenizer = _load_for_eval(spec)
    tokens = eval_windows(tokenizer, dataset, windows, seq_len)
    with _progress() as bar:
        task = bar.add_task(f"perplexity of {spec}", total=windows)
        return perplexity(model, tokens, on_batch=lambda n: bar.advance(task, n))


@app.command()
def quantize(
    model: str = typer.Option("smollm2-135m", help="Model: alias (smollm2-135m), local directory, .gguf file or Hub id."),
    output: Path = typer.Option(..., "--output", "-o", help="Checkpoint directory to create."),
    method: str = typer.Option("rtn", help="rtn | gptq | awq"),
    bits: int = typer.Option(4, help="Weight bits (2..8; the GPTQ format stores 2, 3, 4 or 8)."),
    group_size: int = typer.Option(128, help="Input columns per scale: 32, 64, 128, or -1 for per channel."),
    sym: Optional[bool] = typer.Option(None, "--sym/--asym", help="Symmetric grid (default: the method's own)."),
    dataset: str = typer.Option("sharegpt", help="Calibration data: sharegpt, a .json/.jsonl/.parquet/.txt file, or a datasets id."),
    samples: int = typer.Option(128, help="Calibration sequences."),
    seq_len: int = typer.Option(512, help="Tokens per calibration sequence."),
    seed: int = typer.Option(0, help="Seed for calibration sampling and any random choice."),
    fmt: str = typer.Option("auto", "--format", help="Checkpoint layout: auto | gptq | awq | compressed-tensors (auto: gptq when symmetric, awq when asymmetric 4-bit)."),
    dtype: str = typer.Option("float16", help="dtype of unquantized tensors and scales: float16 | bfloat16."),
    skip: list[str] = typer.Option(["lm_head"], help="Module names (or suffixes) left unquantized; repeatable."),
    damp: Optional[float] = typer.Option(None, help="GPTQ: dampening relative to the mean Hessian diagonal."),
    block_size: Optional[int] = typer.Option(None, help="GPTQ: columns per lazy update block."),
    act_order: Optional[bool] = typer.Option(None, "--act-order/--no-act-order", help="GPTQ: decreasing-Hessian column order."),
    evaluate: bool = typer.Option(False, "--eval", help="Also report held-out perplexity of the result and of the float model."),
    eval_windows: int = typer.Option(80, help="Held-out windows of --seq-len tokens for --eval."),
    overwrite: bool = typer.Option(False, help="Replace an existing output directory."),
    trust_remote_code: bool = typer.Option(False, help="Allow model code from the checkpoint (off by default)."),
):
    """Quantize a causal LM layer by layer and write a deployable checkpoint."""
    import torch

    from toolkit.quant.configs import make_config
    from toolkit.quantize import CalibrationSpec
    from toolkit.quantize import quantize as run_quantize

    try:
        config = make_config(method, bits=bits, group_size=group_size, sym=sym, seed=seed, skip=tuple(skip),
                             damp=damp, block_size=block_size, act_order=act_order)
        with _progress() as bar:
            result = run_quantize(model, config, output, CalibrationSpec(dataset, samples, seq_len), fmt=fmt,
                                  dtype=getattr(torch, DTYPES.get(dtype, "float16")), overwrite=overwrite,
                                  trust_remote_code=trust_remote_code, progress=_RichProgress(bar))
        table = Table(title=f"compound quantize: {method} W{bits} g{group_size}")
        table.add_column("measure")
        table.add_column("value", justify="right")
        table.add_row("output", str(result.output))
        table.add_row("wall time", f"{result.seconds:.1f} s")
        table.add_row("peak memory (RSS)", f"{result.peak_rss_mb:.0f} MiB")
        table.add_row("size on disk", f"{_dir_size(result.output) / 2**20:.1f} MiB")
        if evaluate:
            quantized = _measure_perplexity(str(result.output), dataset, eval_windows, seq_len)
            base = _measure_perplexity(model, dataset, eval_windows, seq_len)
            table.add_row("perplexity, float model", f"{base.perplexity:.3f}")
            table.add_row("perplexity, quantized", f"{quantized.perplexity:.3f} (+{quantized.perplexity - base.perplexity:.3f})")
            table.add_row("held-out tokens scored", str(quantized.tokens))
        Console().print(table)
    except _user_errors() as err:
        _fail(err)


@app.command("eval")
def evaluate(
    model: str = typer.Option(..., help="A compound checkpoint directory, or any model spec (float)."),
    base: Optional[str] = typer.Option(None, help="A second model to score on the same tokens, e.g. the float original."),
    dataset: str = typer.Option("sharegpt", help="Held-out source (its eval split)."),
    windows: int = typer.Option(80, help="Held-out windows."),
    seq_len: int = typer.Option(512, help="Tokens per window."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the results to this JSON file."),
):
    """Perplexity on the held-out split (the same windows for every model)."""
    try:
        rows = [(model, _measure_perplexity(model, dataset, windows, seq_len))]
        if base:
            rows.append((base, _measure_perplexity(base, dataset, windows, seq_len)))
    except _user_errors() as err:
        _fail(err)
    table = Table(title=f"held-out perplexity ({dataset}, {windows}×{seq_len} tokens)")
    for column in ("model", "perplexity", "mean NLL", "tokens"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name, result in rows:
        table.add_row(name, f"{result.perplexity:.3f}", f"{result.nll:.4f}", str(result.tokens))
    Console().print(table)
    if json_out:
        results = [{"model": name, **dataclasses.asdict(result)} for name, result in rows]
        json_out.write_text(json.dumps({"dataset": dataset, "windows": windows, "seq_len": seq_len,
                                        "results": results}, indent=2) + "\n")

