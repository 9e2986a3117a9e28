"""Recipes: one YAML file that takes a model from float to a pushed, gated, deployable checkpoint with heads.

    recipe = load_recipe("recipes/smollm2-135m-demo.yaml")
    summary = run_recipe(recipe, console=Console())

Steps, in order, each one call of an existing verb (the steps a recipe has no section for are left out):

1. quantize    ``toolkit.quantize.quantize`` → ``<output>/checkpoint``
2. evaluate    ``compound eval`` of the quantized model against the float one (``toolkit.evaluate.suite``): perplexity,
               KL and agreement per held-out slice, generation checks; ``<output>/eval/eval.json`` feeds gates and card
3. validate    ``toolkit.validate.validate`` on the checkpoint (hashes, runtime paths, serving preview)
4. heads       ``toolkit.train_heads.train_heads`` → ``<output>/heads``, trained against the quantized checkpoint
               when there is one (heads are trained against the model they serve), else the float model
5. heads_eval  ``toolkit.evaluate.acceptance.validate_heads``: accepted length in tree and chain mode, losslessness
6. gates       thresholds on the numbers above (``check_gates``); a failed gate stops the run before any push
7. push        ``toolkit.hub.push``: the checkpoint to ``push.repo``, the heads to ``push.heads_repo``
               (default ``<repo>-medusa``). Two repos, because engines name a speculative model by its own repo
               id (vLLM's ``--speculative-config '{"model": ...}'``). Skipped, saying so, without a Hub client.

Caching: each step's fingerprint is the SHA-256 of its resolved inputs (the settings it reads, not its whole
section), the fingerprints of the steps it reads from, the model's identity (``toolkit.identity.target_identity``:
a Hub id by the commit it resolves to, local files by their sizes, mtimes and safetensors headers, so planning reads
no weights) and the compound version. ``<output>/.steps/<step>.json`` keeps the fingerprint with the step's results;
with ``resume`` a step whose fingerprint matches and whose outputs exist is not run again. A changed setting therefore
reruns that step and every step downstream of it (evaluate and validate read quantize; heads reads
quantize; heads_eval reads heads; push reads them all), and nothing else. Gates are checked on every run: they read
cached results and cost nothing, so tightening a gate never reruns a step.
"""
from __future__ import annotations

from toolkit.recipes.gates import GateResult, check_gates
from toolkit.recipes.loader import load_recipe
from toolkit.recipes.plan import step_fingerprints
from toolkit.recipes.run import GateError, RunSummary, StepSummary, run_recipe
from toolkit.recipes.schema import Recipe, RecipeError

__all__ = ["GateError", "GateResult", "Recipe", "RecipeError", "RunSummary", "StepSummary", "check_gates", "load_recipe",
           "run_recipe", "step_fingerprints"]
