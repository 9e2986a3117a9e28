"""One adapter per step: each calls one existing verb with the recipe's settings and returns its results."""

from __future__ import annotations

import json

from toolkit.recipes.schema import Recipe


def quantize(recipe: Recipe, console) -> dict:
    """``compound quantize`` of the recipe's model into ``<output>/checkpoint``: format, size, peak memory."""
    from toolkit.quantize import quantize

    q = recipe.quantize
    console.print(f"quantizing {recipe.model}: {q.config.method} W{q.config.bits} g{'auto' if q.config.group_size is None else q.config.group_size} → "
                  f"{recipe.checkpoint}")
    result = quantize(recipe.model, q.config, recipe.checkpoint, recipe.calibration, q.settings, overwrite=True)
    size = sum(p.stat().st_size for p in recipe.checkpoint.rglob("*") if p.is_file())
    manifest = json.loads((recipe.checkpoint / "compound.json").read_text())
    return {"format": manifest["format"], "size_mib": size / 2**20, "peak_rss_mb": result.peak_rss_mb}


def evaluate(recipe: Recipe, console) -> dict:
    """``compound eval`` of the checkpoint against the float model: the eval.json report."""
    from toolkit.evaluate.suite import evaluate

    ev = recipe.evaluate
    console.print(f"evaluating on up to {ev.windows}×{ev.seq_len} held-out tokens per slice of "
                  f"{recipe.calibration.dataset}" + (", with the generation checks" if ev.generation else ""))
    return evaluate(str(recipe.checkpoint), recipe.output / "eval", base=recipe.model,
                    dataset=recipe.calibration.dataset, options=ev, overwrite=True)  # ev holds every EvalOptions field


def validate(recipe: Recipe, console) -> dict:
    """``compound validate`` of the checkpoint: hashes, runtime paths, serving preview."""
    from toolkit.validate import validate

    console.print(f"validating {recipe.checkpoint}")
    return validate(recipe.checkpoint, dataset=recipe.calibration.dataset).to_dict()


def heads(recipe: Recipe, console) -> dict:
    """``compound train-heads`` against the heads' target into ``<output>/heads``."""
    from toolkit.train_heads import train_heads

    h, target = recipe.heads, recipe.heads_target
    job = h.job(target, recipe.heads_dir, recipe.output / "heads.work")
    console.print(f"training {job.kind.describe(job.head_options)} against {target} → {recipe.heads_dir}")
    result = train_heads(job, console)
    return {"target": target, "examples": result.examples, "tokens": result.tokens, "best_step": result.best_step,
            "best_metrics": result.best_metrics}


def heads_eval(recipe: Recipe, console) -> dict:
    """The heads' accepted length and losslessness on held-out prompts (``compound validate --heads``)."""
    import torch

    from toolkit.evaluate.acceptance import validate_heads

    ev = recipe.evaluate
    console.print(f"measuring the heads' accepted length on {ev.prompts} held-out prompts × {ev.max_new_tokens} "
                  f"tokens ({ev.decode_dtype})")
    reports = validate_heads(recipe.heads_target, recipe.heads_dir, ev.prompts, ev.max_new_tokens,
                             dtype=getattr(torch, ev.decode_dtype), categories=ev.categories)
    return {r.mode: r.to_dict() for r in reports}
