"""``compound run`` (a recipe, with its summary table) and ``compound push``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from toolkit.cli import flags
from toolkit.cli.common import app, console, fail, start, user_errors
from toolkit.cli.render import fit
from toolkit.engine.threads import ThreadSettings
from toolkit.hub_options import PushOptions


@app.command()
@flags.derived(ThreadSettings)
def run(
    ctx: typer.Context,
    recipe: Path = typer.Argument(..., help="A recipe YAML file (see recipes/)."),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Skip steps whose fingerprint and outputs are unchanged."),
    dry_run: bool = typer.Option(False, help="Print the plan (steps, fingerprints, which are cached) and run nothing."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Artifact directory (default: the recipe's output, out/<recipe name>)."),
    **options,
):
    """Run a recipe: quantize → evaluate → validate → heads → gates → push, each step cached by fingerprint.
    Exit status 1 when a gate fails (nothing is pushed), 2 for a bad recipe or an input a step refuses."""
    from toolkit.hub import HubError
    from toolkit.recipes import GateError, RecipeError, load_recipe, run_recipe

    start(ctx, options)
    try:
        loaded = load_recipe(recipe)
    except RecipeError as err:
        fail(err)
    if output is not None:
        loaded = dataclasses.replace(loaded, output=output)
    wants_push = loaded.push is not None and loaded.push.enabled and not dry_run
    try:
        run_recipe(loaded, resume=resume, dry_run=dry_run, api=_hub_client() if wants_push else None, console=console,
                   show=lambda summary: console.print(fit(_summary_table(summary))))
    except GateError:
        raise typer.Exit(1)  # the failed gates and the summary are printed already
    except (*user_errors(), HubError, ValueError) as err:
        fail(err)


def _hub_client():
    """An ``HfApi`` when a Hugging Face token is configured (HF_TOKEN or ``hf auth login``), else None: no push."""
    from huggingface_hub import HfApi, get_token

    return HfApi() if get_token() else None


@app.command()
@flags.derived(PushOptions)
def push(
    directory: Path = typer.Argument(..., help="An artifact directory compound wrote (checkpoint or heads, with compound.json)."),
    results: Optional[Path] = typer.Option(None, help="Measured results (JSON) for the model card's tables (toolkit.hub documents the keys), or an eval.json."),
    **options,
):
    """Publish an artifact with its model card as one commit; the token comes from HF_TOKEN or `hf auth login`."""
    from huggingface_hub import HfApi

    from toolkit.hub import HubError
    from toolkit.model_card import card_results
    from toolkit.hub import push as run_push

    settings = flags.build(PushOptions, options)
    try:
        measured = card_results(json.loads(results.read_bytes())) if results else None
        out = run_push(HfApi(), directory, settings.repo, private=settings.private, revision=settings.revision,
                       tags=settings.tags, commit_message=settings.commit_message, results=measured)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        fail(ValueError(f"--results {results}: not valid JSON ({err}); pass an eval.json or a results file"))
    except (HubError, OSError) as err:
        fail(err)
    Console().print(f"pushed {len(out.files)} files to {out.repo_url}\ncommit {out.commit_oid}", markup=False,
                    highlight=False, soft_wrap=True)  # unwrapped, to copy


def _key_numbers(step) -> str:
    """The figures of one step worth a glance in the run summary."""
    r = step.results
    if step.note or not r:
        return step.note
    if step.name == "quantize":
        return f"{r['format']}, {r['size_mib']:.1f} MiB"
    if step.name == "evaluate":
        overall, worst = r["overall"], r["worst_slice"]
        return (f"ppl {overall['base_perplexity']:.3f} → {overall['perplexity']:.3f} "
                f"(×{overall['perplexity_ratio']:.3f}), KL {overall['kl']:.4f}, top-1 {overall['top1_agreement']:.1%}"
                f"; worst {worst} ×{r['slices'][worst]['perplexity_ratio']:.3f}")
    if step.name == "validate":
        return f"{'ok' if r['ok'] else 'FAILED'}: " + ", ".join(f"{p['path']} {'ok' if p['ok'] else 'NO'}"
                                                                for p in r["paths"])
    if step.name == "heads":
        length = r["best_metrics"].get("mean_accepted_length") if r["best_metrics"] else None
        return f"{r['examples']} examples, best step {r['best_step']}" + (f", τ {length:.3f}" if length else "")
    if step.name == "heads_eval":
        return ", ".join(f"τ {mode} {m['mean_accepted_length']:.3f} ({m['speedup']:.2f}x)" for mode, m in r.items()) \
            + ("; lossless" if all(m["lossless"] for m in r.values()) else "; NOT lossless")
    return ", ".join(r)  # push: the repos


def _summary_table(summary) -> Table:
    """The Rich table of a recipe run (or, for a dry run, of its plan): step, status, seconds, key numbers."""
    table = Table(title=f"compound run {summary.recipe}{' (dry run)' if summary.dry_run else ''} → {summary.output}")
    for column in ("step", "status", "fingerprint" if summary.dry_run else "seconds", "key numbers"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    colours = {"ran": "green", "cached": "cyan", "failed": "bold red", "skipped": "yellow", "would run": "magenta"}
    for s in summary.steps:
        third = (s.fingerprint or "-")[:12] if summary.dry_run else f"{s.seconds:.1f}"
        table.add_row(s.name, f"[{colours[s.status]}]{s.status}[/]", third, _key_numbers(s))
    return table
