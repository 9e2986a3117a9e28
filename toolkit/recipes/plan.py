"""A recipe's steps in order, with the settings each reads, and their fingerprints."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from toolkit.recipes import steps
from toolkit.recipes.schema import Recipe
from toolkit.version import __version__

PLACEMENT = frozenset({"device"})  # settings that choose where a step computes, not what: out of its fingerprint


@dataclass(frozen=True)
class Step:
    """One step of a run: its name, the settings it reads, the steps it reads from, what it must leave behind."""

    name: str
    inputs: dict  # the settings the step reads, resolved
    needs: tuple[str, ...]  # the steps whose outputs it reads
    outputs: tuple[Path, ...]  # files that must exist for a cached result to count
    run: Callable[[Recipe, object], dict]  # reads its inputs from the recipe, its upstream steps' outputs from disk
    work: Path | None = None  # the step's own resumable state, kept only for the same fingerprint (``_prepare_work``)


def plan(recipe: Recipe) -> list[Step]:
    """The steps this recipe has, in order, with their resolved inputs (gates and push are handled by the run)."""
    cal, q, h, ev = recipe.calibration, recipe.quantize, recipe.heads, recipe.evaluate
    planned = []
    if q:
        needs_data = q.config.needs_activations or q.settings.kv_cache is not None  # RTN alone reads no tokens
        planned += [
            Step("quantize", {"quantize": {"config": q.config.to_dict(), "settings": _what(asdict(q.settings))},
                              "calibration": asdict(cal) if needs_data else None}, (),
                  (recipe.checkpoint / "compound.json",), steps.quantize),
            Step("evaluate", {"dataset": cal.dataset, "windows": ev.windows, "seq_len": ev.seq_len,
                               "kl_threshold": ev.kl_threshold,
                               "generation": ev.generation_tokens if ev.generation else None}, ("quantize",),
                  (recipe.output / "eval" / "eval.json",), steps.evaluate),
            Step("validate", {"dataset": cal.dataset}, ("quantize",), (), steps.validate),
        ]
    if h:
        planned += [
            Step("heads", {"heads": _what(asdict(h))}, ("quantize",) if q else (),
                  (recipe.heads_dir / "compound.json",), steps.heads, recipe.output / "heads.work"),
            Step("heads_eval", {"prompts": ev.prompts, "max_new_tokens": ev.max_new_tokens,
                                "decode_dtype": ev.decode_dtype, "categories": ev.categories},
                 ("heads",), (), steps.heads_eval),
        ]
    return planned


def _what(settings: dict) -> dict:
    """A section's settings without those that choose where a step computes (``device``): a run resumed on a GPU
    reuses what the CPU made, as a change of ``--threads`` would."""
    return {key: value for key, value in settings.items() if key not in PLACEMENT}


def step_fingerprints(recipe: Recipe, api=None) -> dict[str, str]:
    """SHA-256 per step of its resolved inputs, upstream fingerprints, model identity and compound version; push's
    reads every measuring step and the push section. The model's identity reads no weights: a Hub id's resolved
    revision (asked of ``api``, an ``HfApi``), a local model's file sizes, mtimes and safetensors headers
    (``toolkit.identity``)."""
    from toolkit.identity import target_identity

    model = target_identity(recipe.model, api)
    prints: dict[str, str] = {}

    def digest(name: str, inputs: dict, needs) -> str:
        payload = {"step": name, "inputs": inputs, "upstream": {n: prints[n] for n in needs}, "model": model,
                   "compound": __version__}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    for step in plan(recipe):
        prints[step.name] = digest(step.name, step.inputs, step.needs)
    if recipe.push:
        prints["push"] = digest("push", asdict(recipe.push), tuple(prints))
    return prints
