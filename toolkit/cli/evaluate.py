"""``compound eval`` and ``compound validate`` (of a checkpoint, or of heads with ``--heads``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from toolkit.cli import flags
from toolkit.cli.common import app, console, fail, progress_bar, start, user_errors
from toolkit.cli.render import fit
from toolkit.engine.threads import ThreadSettings
from toolkit.evaluate.acceptance import CATEGORIES
from toolkit.evaluate.suite import WINDOWS_PER_SLICE

HEADS_DTYPES = ("float32", "bfloat16")  # the target's dtypes the decode loop of --heads runs in
HeadsDtype = flags.choice(HEADS_DTYPES)


@app.command("eval")
@flags.derived(ThreadSettings)
def evaluate(
    ctx: typer.Context,
    model: str = typer.Option(..., help="A compound checkpoint directory, or any model spec (float)."),
    base: Optional[str] = typer.Option(None, help="The model to compare with (e.g. the float original): KL, agreement, perplexity ratios."),
    heads: Optional[Path] = typer.Option(None, help="Medusa or EAGLE heads trained for --model: accepted length per slice."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Report directory (eval.json, eval.md, plots); default: <model>.eval next to a checkpoint, else eval-<model>."),
    dataset: str = typer.Option("sharegpt", help="Held-out source (its eval split)."),
    windows: int = typer.Option(WINDOWS_PER_SLICE, help="Held-out windows per slice (each perplexity and ratio "
                                "prints with its 95 % interval over windows)."),
    seq_len: int = typer.Option(512, help="Tokens per window."),
    kl_threshold: float = typer.Option(1.0, help="Report the share of tokens whose KL(base ‖ model) exceeds this (nats): where the model breaks."),
    generation: bool = typer.Option(True, "--generation/--no-generation", help="Run the JSON / code / factual generation checks."),
    new_tokens: int = typer.Option(96, help="Tokens decoded per generation-check prompt."),
    head_prompts: int = typer.Option(4, help="With --heads: held-out prompts per slice."),
    head_tokens: int = typer.Option(64, help="With --heads: tokens decoded per prompt."),
    overwrite: bool = typer.Option(False, help="Replace an existing report directory."),
    **options,
):
    """Task-level quality on held-out slices (prose, code, non-English, structured), generation checks, accepted
    length per slice; writes eval.json and eval.md."""
    from toolkit.evaluate.generation import SETS
    from toolkit.evaluate.report import console_tables
    from toolkit.evaluate.suite import evaluate as run_eval

    threads = start(ctx, options)
    path = Path(model)
    output = output or (path.with_name(path.name + ".eval") if path.is_dir() else Path(f"eval-{path.name}"))
    try:
        with progress_bar() as bar:
            report = run_eval(model, output, base=base, heads=heads, dataset=dataset, windows=windows,
                              seq_len=seq_len, kl_threshold=kl_threshold, generation_sets=SETS if generation else (),
                              new_tokens=new_tokens, head_prompts=head_prompts, head_tokens=head_tokens,
                              overwrite=overwrite, say=bar.console.log, progress=phases(bar))
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


def _categories(value: str) -> list[str]:
    """``--categories``: comma-separated names of ``CATEGORIES``, refused (exit 2) otherwise."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names or any(name not in CATEGORIES for name in names):
        raise typer.BadParameter(f"takes comma-separated prompt sets of {', '.join(CATEGORIES)}, got {value!r}")
    return names


@app.command()
@flags.derived(ThreadSettings)
def validate(
    ctx: typer.Context,
    model: str = typer.Option(..., help="A quantized checkpoint directory (GPTQ, AWQ or compressed-tensors); with --heads, the target model (any model spec)."),
    heads: Optional[Path] = typer.Option(None, help="A draft-head directory (from train-heads): measure its accepted length on --model instead."),
    prompts: int = typer.Option(8, help="With --heads: held-out prompts decoded."),
    max_new_tokens: int = typer.Option(64, help="With --heads: tokens generated per prompt."),
    heads_dtype: HeadsDtype = typer.Option("float32", "--dtype",
                                           help="With --heads: the target's dtype in the decode loop."),
    categories: str = typer.Option("all", callback=_categories,
                                   help="With --heads: held-out prompt sets, comma-separated, each reported apart: "
                                        f"{', '.join(CATEGORIES)}."),
    dataset: str = typer.Option("sharegpt", help="Held-out source (its eval split)."),
    windows: int = typer.Option(2, help="Held-out windows run on every path."),
    seq_len: int = typer.Option(64, help="Tokens per window (at most 256, where cpu-int4 hands over to the reference)."),
    triton_layers: Optional[int] = typer.Option(None, help="Decoder layers run on the Triton kernels (default: all on CUDA, 1 under the CPU interpreter)."),
    triton_tokens: Optional[int] = typer.Option(None, help="Tokens of window 0 run on Triton (default: all on CUDA, 16 under the CPU interpreter)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the report to this JSON file."),
    **options,
):
    """Check a checkpoint's hashes, run held-out tokens on every runtime path, and preview how engines serve it;
    with --heads, measure the heads' accepted length, per-head acceptance and speedup, lossless checked."""
    from toolkit.validate import validate as run_validate

    start(ctx, options)
    if heads is not None:
        _validate_heads(model, heads, prompts, max_new_tokens, heads_dtype, categories, json_out)
        return

    try:
        with progress_bar() as bar:
            report = run_validate(model, dataset=dataset, windows=windows, seq_len=seq_len,
                                  triton_layers=triton_layers, triton_tokens=triton_tokens, say=bar.console.log,
                                  progress=phases(bar))
    except (*user_errors(), ValueError) as err:
        fail(err)
    out = Console()
    out.print(f"manifest: {report.manifest_files} files, SHA-256 intact" if report.manifest_files
              else "manifest: none (compound.json absent), bytes not checked")
    out.print(fit(paths_table(report, dataset, windows, seq_len)))
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


def _validate_heads(model: str, heads: Path, prompts: int, max_new_tokens: int, dtype: str, categories: list[str],
                    json_out: Optional[Path]) -> None:
    import torch

    from toolkit.evaluate.acceptance import recommended, validate_heads

    try:
        reports = validate_heads(model, heads, prompts, max_new_tokens, dtype=getattr(torch, dtype),
                                 categories=categories)
    except (*user_errors(), ValueError) as err:
        fail(err)
    title = f"heads {heads} drafting for {model} ({dtype}): {prompts} held-out prompts × {max_new_tokens} tokens"
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
