"""The ``eval`` verb: score a model on held-out slices, against its base when given, run the generation checks and,
with heads, measure accepted length per slice; write the report (``toolkit.evaluate.report``) atomically.

Steps: 1. load the model (a compound checkpoint through the runtime loader, else a float model) and the base;
2. pack the eval split into windows per slice; 3. perplexity per slice (and KL, agreement against the base, the two
models side by side one batch at a time); 4. generation checks on both; 5. free both, then with ``heads`` measure
the heads drafting for the model per slice (``validate_heads`` loads its own copy); 6. write ``output``.
"""

from __future__ import annotations

import gc
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from toolkit.calibration.sources import CalibrationError
from toolkit.evaluate.divergence import KL_EDGES, combine, divergence
from toolkit.evaluate.generation import SETS, run_checks
from toolkit.evaluate.options import EvalHeadsOptions, EvalOptions, HeldOut
from toolkit.evaluate.perplexity import Perplexity, perplexity, perplexity_interval, ratio_interval
from toolkit.evaluate.report import SCHEMA, write_report
from toolkit.evaluate.slices import SLICES, slice_windows
from toolkit.formats.checkpoint import atomic_directory
from toolkit.models import ModelError, ModelSource, resolve_model
from toolkit.runtime.load import read_manifest

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
Phase = Callable[[str, int], Callable[[int], None]]  # (phase, total steps) → what counts the steps done


def evaluate(model: str | ModelSource, output: Path | str | None = None, *, base: str | ModelSource | None = None,
             heads: Path | str | None = None,
             dataset: str = HeldOut.dataset, options: EvalOptions = EvalOptions(),
             heads_options: EvalHeadsOptions = EvalHeadsOptions(), overwrite: bool = False,
             say: Callable[[str], None] = lambda _: None, progress: Phase | None = None) -> dict:
    """Evaluate ``model`` (a compound checkpoint or any model spec, resolved once here, or its ``ModelSource``), against
    ``base`` when given (likewise), and return the report (schema ``compound.eval/1``); with ``output``, also write
    ``eval.json``, ``eval.md`` and the plots there (atomically).

    options: windows × seq_len held-out tokens per slice of ``dataset``'s eval split, the KL threshold, whether the
    generation checks run and how many tokens each decodes. heads_options: held-out prompts per slice and tokens
    decoded for ``heads``. say: one line per step; progress(phase, total): starts a phase (scoring a slice, a
    generation set on a model) and returns what counts its windows or prompts done.
    """
    from toolkit.runtime.load import load_model_or_checkpoint

    if output is not None and Path(output).exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")
    windows, seq_len, new_tokens = options.windows, options.seq_len, options.generation_tokens
    generation_sets = SETS if options.generation else ()
    model, base = (resolve_model(spec) if spec else None for spec in (model, base))
    for source in filter(None, (model, base)):  # windows longer than either model's context, before any weight loads
        source.check_seq_len(seq_len)
    started = time.perf_counter()
    model_name, base_name = model.spec, base and base.spec
    say(f"loading {model_name}" + (f" and {base_name}" if base else ""))
    target, tokenizer = load_model_or_checkpoint(model, torch.float32)  # 1
    reference = None
    if base:
        reference, base_tokenizer = load_model_or_checkpoint(base, torch.float32)
        if base_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ModelError(f"{model_name} and {base_name} have different tokenizers: their next-token distributions "
                             "cannot be compared")
    say(f"packing the eval split of {dataset} into up to {windows}×{seq_len} tokens per slice")
    per_slice = slice_windows(tokenizer, dataset, windows, seq_len)  # 2
    if not any(w.shape[0] for w in per_slice.values()):
        raise CalibrationError(f"the eval split of {dataset} fills no {seq_len}-token window; lower --seq-len or pass "
                               "a larger --dataset")
    say("scoring the slices" + (" against the base" if base else ""))
    slices, scored = _score_slices(target, reference, per_slice, options.kl_threshold, progress)  # 3
    total = combine(scored) if reference is not None else _total_perplexity(scored)
    generation = None
    if generation_sets:
        say(f"generation checks ({', '.join(generation_sets)}), greedy, {new_tokens} new tokens")
        models = {"model": target, **({"base": reference} if reference is not None else {})}
        generation = {r.set: {key: value for key, value in asdict(r).items() if key != "set"}
                      for r in run_checks(models, tokenizer, new_tokens, generation_sets, progress=progress)}  # 4
    del target, reference
    gc.collect()
    acceptance = None
    if heads:
        say(f"measuring {heads} drafting for {model_name} per slice")
        acceptance = _acceptance(model, heads, heads_options.head_prompts, heads_options.head_tokens)  # 5
    report = {
        "schema": SCHEMA, "model": model_name, "base": base_name, "heads": str(heads) if heads else None,
        "dataset": dataset, "seq_len": seq_len, "windows_per_slice": windows, "kl_threshold": options.kl_threshold,
        "slices": slices, "overall": _row(total, sum(r["windows"] for r in slices.values()), base is not None),
        "worst_slice": max((n for n in slices if slices[n]["tokens"]), key=lambda n: slices[n]["perplexity_ratio"])
        if base else None,
        "kl_histogram": {"lower_edges": list(KL_EDGES[:-1]), "counts": list(total.kl_counts)}
        if base else None,
        "generation": generation, "acceptance": acceptance, "layer_errors": layer_errors(model_name),
        "seconds": time.perf_counter() - started,
    }
    if output is not None:  # 6
        with atomic_directory(Path(output), overwrite) as staging:
            write_report(report, staging)
    return report


def layer_errors(model: str) -> dict | None:
    """The quantizer's error per decoder layer (mean over its linears) from a checkpoint's manifest, if recorded."""
    recorded = read_manifest(model).get("layer_errors")
    if not recorded or not recorded.get("linears"):
        return None
    by_layer: dict[int, list[float]] = {}
    for name, error in recorded["linears"].items():
        if match := _LAYER_INDEX.search(name):
            by_layer.setdefault(int(match.group(1)), []).append(error)
    return {"measure": recorded["measure"], "layers": [sum(v) / len(v) for _, v in sorted(by_layer.items())]}


def _score_slices(target, reference, per_slice: dict[str, torch.Tensor], kl_threshold: float,
                  progress: Phase | None):
    """Slice → metrics dict (schema keys), and the raw results of the non-empty slices, to total."""
    slices, scored = {}, []
    for name in SLICES:
        tokens = per_slice.get(name)
        if tokens is None or not tokens.shape[0]:
            slices[name] = _row(None, 0, False)
            continue
        advance = progress(f"scoring {name}", tokens.shape[0]) if progress else None
        result = (divergence(target, reference, tokens, kl_threshold=kl_threshold, on_batch=advance)
                  if reference is not None else perplexity(target, tokens, on_batch=advance))
        scored.append(result)
        slices[name] = _row(result, tokens.shape[0], reference is not None)
    return slices, scored


def _total_perplexity(parts: list[Perplexity]) -> Perplexity:
    tokens = sum(p.tokens for p in parts)
    nll = sum(p.nll * p.tokens for p in parts) / tokens
    return Perplexity(math.exp(nll), nll, tokens, tuple(w for p in parts for w in p.window_nll))


def _row(result, windows: int, against_base: bool) -> dict:
    """A slice's metrics under the schema's keys (None where not measured)."""
    row = {"tokens": result.tokens if result else 0, "windows": windows,
           "perplexity": result.perplexity if result else None,
           "perplexity_ci95": _listed(perplexity_interval(result.window_nll)) if result else None}
    measured = result is not None and against_base
    row |= {"base_perplexity": result.base_perplexity if measured else None,
            "perplexity_ratio": result.perplexity / result.base_perplexity if measured else None,
            "ratio_ci95": _listed(ratio_interval(result.window_nll, result.base_window_nll)) if measured else None}
    for key in ("kl", "kl_above", "top1_agreement", "top5_agreement"):
        row[key] = getattr(result, key) if measured else None
    return row


def _listed(interval: tuple[float, float] | None) -> list[float] | None:
    return list(interval) if interval else None


def _acceptance(model: ModelSource, heads: Path | str, prompts: int, new_tokens: int) -> dict:
    from toolkit.evaluate.acceptance import validate_heads

    reports = {r.mode: r for r in validate_heads(model, heads, prompts, new_tokens, categories=("all", *SLICES),
                                                 explore=False)}
    out = {}
    for name in ("all", *SLICES):
        suffix = "" if name == "all" else f" ({name})"
        tree, chain = reports.get("tree" + suffix), reports.get("chain" + suffix)
        if tree is None:
            continue
        out[name] = {"prompts": len(tree.per_prompt_accepted_length),
                     "tree_accepted_length": tree.mean_accepted_length,
                     "chain_accepted_length": chain.mean_accepted_length,
                     "tree_speedup": tree.speedup, "lossless": tree.lossless and chain.lossless}
    return out
