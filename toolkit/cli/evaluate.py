"""``compound eval`` and ``compound validate`` (of a checkpoint, or of heads with ``--heads``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from toolkit.cli import flags
from toolkit.cli.common import app, console, fail, progress_bar, start, user_errors
from toolkit.cli.render import fit
from toolkit.engine.threads import ThreadSettings
from toolkit.evaluate.options import EvalHeadsOptions, EvalOptions, HeadsCheckOptions, HeldOut
from toolkit.validate import ValidateOptions


@app.command("eval")
@flags.derived(HeldOut, EvalOptions, EvalHeadsOptions, ThreadSettings)
def evaluate(
    ctx: typer.Context,
    model: str = typer.Option(..., help="A compound checkpoint directory, or any model spec (float)."),
    base: Optional[str] = typer.Option(None, help="The model to compare with (e.g. the float original): KL, agreement, perplexity ratios."),
    heads: Optional[Path] = typer.Option(None, help="Medusa or EAGLE heads trained for --model: accepted length per slice."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Report directory (eval.json, eval.md, plots); default: <model>.eval next to a checkpoint, else eval-<model>."),
    overwrite: bool = typer.Option(False, help="Replace an existing report directory."),
    **options,
):
    """Task-level quality on held-out slices (prose, code, non-English, structured), generation checks, accepted
    length per slice; writes eval.json and eval.md."""
    from toolkit.evaluate.report import console_tables
    from toolkit.evaluate.suite import evaluate as run_eval

    threads = start(ctx, options)
    path = Path(model)
    output = output or (path.with_name(path.name + ".eval") if path.is_dir() else Path(f"eval-{path.name}"))
    try:
        settings = flags.build(EvalOptions, options)
        with progress_bar() as bar:
            report = run_eval(model, output, base=base, heads=heads, dataset=flags.build(HeldOut, options).dataset,
                              options=settings,
                              heads_options=flags.build(EvalHeadsOptions, options), overwrite=overwrite,
                              say=bar.console.log, progress=phases(bar))
    except user_errors() as err:
        fail(err)
    for table in console_tables(report):
        Console().print(fit(table))
    if report["worst_slice"]:
        Console().print(f"degrades most: {report['worst_slice']}")
    console.print(f"wrote {output}/eval.json and {output}/eval.md in {report['seconds']:.0f} s on {threads}")


def phases(bar):
    """The ``progress`` of ``evaluate`` and ``validate``: one bar with counts per phase; outside a terminal (where
    Rich draws the bars once, at the end) also a line as each phase finishes."""

    def phase(name: str, total: int):
        task, done = bar.add_task(name, total=total), 0

        def advance(n: int) -> None:
            nonlocal done
            bar.advance(task, n)
            done += n
            if not bar.console.is_terminal and done == total:
                bar.console.log(f"{name}: {done}/{total} done")

        return advance

    return phase


@app.command()
@flags.derived(HeldOut, ValidateOptions, HeadsCheckOptions, ThreadSettings)
def validate(
    ctx: typer.Context,
    model: str = typer.Option(..., help="A quantized checkpoint directory (GPTQ, AWQ or compressed-tensors); with --heads, the target model (any model spec)."),
    heads: Optional[Path] = typer.Option(None, help="A draft-head directory (from train-heads): measure its accepted length on --model instead."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the report to this JSON file."),
    **options,
):
    """Check a checkpoint's hashes, run held-out tokens on every runtime path, and preview how engines serve it;
    with --heads, measure the heads' accepted length, per-head acceptance and speedup, lossless checked."""
    from toolkit.validate import validate as run_validate

    start(ctx, options)
    dataset = flags.build(HeldOut, options).dataset
    try:
        if heads is not None:
            check = flags.build(HeadsCheckOptions, options)  # refused (exit 2) before any work
        else:
            settings = flags.build(ValidateOptions, options)
    except ValueError as err:
        fail(err)
    if heads is not None:
        _validate_heads(model, heads, check, json_out)
        return

    try:
        with progress_bar() as bar:
            report = run_validate(model, dataset=dataset, **asdict(settings), say=bar.console.log,
                                  progress=phases(bar))
    except (*user_errors(), ValueError) as err:
        fail(err)
    out = Console()
    out.print(f"manifest: {report.manifest_files} files, SHA-256 intact" if report.manifest_files
              else "manifest: none (compound.json absent), bytes not checked")
    out.print(fit(paths_table(report, dataset, settings.windows, settings.seq_len)))
    s = report.serving
    out.print(fit(serving_table(s)))
    out.print("serve it with (vLLM on GPU, vLLM on CPU, SGLang):")
    for command in (s.vllm_command, s.vllm_cpu_command, s.sglang_command):  # unwrapped, to copy and paste
        out.print(f"  {command}", soft_wrap=True, markup=False, highlight=False)
    if json_out:
        json_out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    if not report.ok:
        console.print("[bold red]validation failed:[/] a runtime path disagrees with the reference, or an engine "
                      "cannot serve the checkpoint (see the tables above)")
        raise typer.Exit(1)


def paths_table(report, dataset: str, windows: int, seq_len: int) -> Table:
    """Each runtime path of a ``ValidationReport`` against the reference: logit differences, agreement, verdict."""
    table = Table(title=f"runtime paths vs the reference ({dataset}, {windows}×{seq_len} held-out tokens)")
    for column in ("path", "layers", "positions", "max |Δ logit|", "/ max |logit|", "top-1 agreement", "ok", "note"):
        table.add_column(column, justify="left" if column in ("path", "layers", "note") else "right")
    for p in report.paths:
        numbers = ("-", "-", "-") if p.max_logit_diff is None else \
            (f"{p.max_logit_diff:.3g}", f"{p.relative_diff:.1e}", f"{p.top1_agreement:.2%}")
        table.add_row(p.path, p.layers, str(p.positions), *numbers, "yes" if p.ok else "[bold red]NO[/]", p.note)
    return table


def serving_table(s) -> Table:
    """How vLLM serves the checkpoint on GPU and CPU, and why; the problems an engine would refuse it for."""
    table = Table(title=f"serving preview: {s.quant_method}, {s.scheme}", show_lines=True)
    for column in ("engine", "path", "why"):
        table.add_column(column)
    table.add_row("vLLM, GPU", s.vllm_gpu, s.vllm_gpu_why)
    table.add_row("vLLM, CPU", s.vllm_cpu, s.vllm_cpu_why)
    for problem in s.problems:
        table.add_row("[bold red]problem[/]", "", problem)
    return table


def heads_table(reports, title: str) -> Table:
    """One row per decoding mode of ``validate --heads``: accepted length, speed, losslessness."""
    table = Table(title=title)
    for column in ("mode", "shape", "accepted length", "acceptance per depth", "tokens/s", "greedy tokens/s",
                   "speedup", "draft / verify ms per step", "break-even length", "lossless"):
        table.add_column(column, justify="left" if column in ("mode", "shape", "acceptance per depth") else "right")
    for r in reports:
        table.add_row(r.mode, r.shape, f"{r.mean_accepted_length:.3f}",
                      " ".join(f"{a:.2f}" for a in r.acceptance_rate), f"{r.speculative_tokens_per_s:.1f}",
                      f"{r.greedy_tokens_per_s:.1f}", f"{r.speedup:.2f}x",
                      f"{r.draft_ms_per_step:.1f} / {r.verify_ms_per_step:.1f}", f"{r.break_even_accepted_length:.2f}",
                      "yes" if r.lossless else "[bold red]NO[/]")
    return table


def _validate_heads(model: str, heads: Path, check: HeadsCheckOptions, json_out: Optional[Path]) -> None:
    import torch

    from toolkit.evaluate.acceptance import recommended, validate_heads

    try:
        reports = validate_heads(model, heads, check.prompts, check.max_new_tokens,
                                 dtype=getattr(torch, check.decode_dtype), categories=check.categories)
    except (*user_errors(), ValueError) as err:
        fail(err)
    title = (f"heads {heads} drafting for {model} ({check.decode_dtype}): {check.prompts} held-out prompts × "
             f"{check.max_new_tokens} tokens")
    Console().print(fit(heads_table(reports, title)))
    Console().print("break-even length: the accepted length at which a step (draft + verify) costs what plain "
                    "greedy decoding takes for one token; speedup ≈ accepted length / break-even length")
    best = recommended(reports)
    Console().print(f"recommended: {best.mode} ({best.shape}), {best.speculative_tokens_per_s:.1f} tokens/s, "
                    f"{best.speedup:.2f}x plain greedy")
    if json_out:
        json_out.write_text(json.dumps([r.to_dict() for r in reports], indent=2) + "\n")
    if not all(r.lossless for r in reports):
        console.print("[bold red]validation failed:[/] speculative output differs from plain greedy decoding")
        raise typer.Exit(1)
