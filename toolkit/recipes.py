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
7. push        ``toolkit.hub.push``: the checkpoint to ``push.repo_id``, the heads to ``push.heads_repo_id``
               (default ``<repo_id>-medusa``). Two repos, because engines name a speculative model by its own repo
               id (vLLM's ``--speculative-config '{"model": ...}'``). Skipped, saying so, without a Hub client.

Caching: each step's fingerprint is the SHA-256 of its resolved inputs (the settings it reads, not its whole
section), the fingerprints of the steps it reads from, the model's identity (name and weight hash, as
``target_identity``; a Hub id by its name alone) and the compound version. ``<output>/.steps/<step>.json`` keeps the fingerprint with the
step's results; with ``resume`` a step whose fingerprint matches and whose outputs exist is not run again. A changed
setting therefore reruns that step and every step downstream of it (evaluate and validate read quantize; heads reads
quantize; heads_eval reads heads; push reads them all), and nothing else. Gates are checked on every run: they read
cached results and cost nothing, so tightening a gate never reruns a step.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import shutil
import time
import types
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from toolkit.version import __version__
from toolkit.quant.configs import METHODS, SUPPORTED_GROUP_SIZES, ConfigError, make_config

NO_TOKEN = ("no Hugging Face token configured (set HF_TOKEN or run `hf auth login`), so nothing was pushed; "
            "set push.enabled: false to silence this")


class RecipeError(ValueError):
    """A recipe that cannot run; the message starts with ``file:line: key:``."""


class GateError(RuntimeError):
    """One or more gates failed; ``summary`` holds every step and gate, the message names the failed gates."""

    def __init__(self, summary: RunSummary):
        self.summary = summary
        super().__init__("; ".join(str(g) for g in summary.gates if not g.passed))


class _Invalid(ValueError):
    """Raised by a section's checks: the key at fault ("" for the section) and what is wrong with it."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _choice(key: str, value, choices) -> None:
    if value not in choices:
        raise _Invalid(key, f"{value!r} is not supported; must be one of {', '.join(map(str, choices))}")


def _at_least(section, minimum, *keys: str) -> None:
    for key in keys:
        if getattr(section, key) < minimum:
            raise _Invalid(key, f"must be >= {minimum}, got {getattr(section, key)}")


# ---- schema -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CalibrationSection:
    """The data source for calibration (its calibration split), evaluation (eval split) and heads (train split);
    ``samples`` × ``seq_len`` calibration tokens drawn with ``seed``."""

    dataset: str = "sharegpt"
    samples: int = 128
    seq_len: int = 512
    seed: int = 0

    def __post_init__(self):
        _at_least(self, 1, "samples", "seq_len")


@dataclass(frozen=True)
class QuantizeSection:
    """``compound quantize``'s options: method, bits, group_size, sym (None: the method's own), act_order (GPTQ),
    format, kv_cache (fp8 | int8 static scales), dtype of the unquantized tensors, skip (modules left in float)."""

    method: str = "gptq"
    bits: int = 4
    group_size: int = 128
    sym: bool | None = None
    act_order: bool | None = None
    format: str = "auto"
    kv_cache: str | None = None
    kv_cache_strategy: str = "tensor"
    dtype: str = "float16"
    skip: tuple[str, ...] = ("lm_head",)

    def __post_init__(self):
        from toolkit.quant import kv_cache as kv
        from toolkit.quantize import FORMATS, choose_format

        _choice("method", self.method, sorted(METHODS))
        if not 2 <= self.bits <= 8:
            raise _Invalid("bits", f"must be between 2 and 8, got {self.bits}")
        _choice("group_size", self.group_size, (*sorted(g for g in SUPPORTED_GROUP_SIZES if g > 0), -1))
        _choice("format", self.format, ("auto", *FORMATS))
        _choice("kv_cache", self.kv_cache, (None, *kv.QMAX))
        _choice("kv_cache_strategy", self.kv_cache_strategy, kv.STRATEGIES)
        _choice("dtype", self.dtype, ("float16", "bfloat16"))
        if self.act_order is not None and self.method not in ("gptq", "awq+gptq"):
            raise _Invalid("act_order", f"is a GPTQ option; method {self.method!r} has none (use gptq or awq+gptq)")
        config = self.config(seed=0)
        fmt = choose_format(config) if self.format == "auto" else self.format
        try:
            FORMATS[fmt].check_supported(config)
        except ConfigError as err:
            raise _Invalid("format", f"{fmt}: {err}") from None

    def config(self, seed: int):
        """The method's frozen config (``toolkit.quant.configs``), seeded by the calibration seed."""
        try:
            return make_config(self.method, bits=self.bits, group_size=self.group_size, sym=self.sym, seed=seed,
                               skip=tuple(self.skip), act_order=self.act_order)
        except ConfigError as err:
            raise _Invalid("", str(err)) from None


@dataclass(frozen=True)
class HeadsSection:
    """``compound train-heads``'s options. type: medusa, eagle (EAGLE-1/2) or eagle3. steps: optimizer steps;
    eval_every: steps between acceptance evaluations (a checkpoint is saved at each, so a resumed run never repeats
    one); eval_prompts / eval_tokens: held-out prompts and tokens per prompt for checkpoint selection. num_heads /
    num_layers: Medusa's; aux_layers, draft_vocab, ttt_steps: EAGLE-3's; depth, top_k, draft_tokens: the EAGLE draft
    shape selected on (the tree, or the chain of ``depth`` with select_mode chain)."""

    type: str = "medusa"
    num_heads: int = 4
    num_layers: int = 1
    aux_layers: tuple[int, ...] | None = None
    draft_vocab: int = 32000
    ttt_steps: int = 5
    depth: int = 5
    top_k: int = 4
    draft_tokens: int = 8
    samples: int = 1000
    max_len: int = 1024
    distill_tokens: int = 256
    distill_batch: int = 16
    dtype: str = "bfloat16"
    steps: int = 600
    batch_size: int = 8
    micro_batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int = 20
    train_dtype: str = "bf16"
    eval_every: int = 100
    eval_prompts: int = 4
    eval_tokens: int = 64
    select_mode: str = "tree"
    layout: str = "vllm"
    seed: int = 0

    def __post_init__(self):
        _choice("type", self.type, ("medusa", "eagle", "eagle3"))
        _choice("dtype", self.dtype, ("bfloat16", "float16", "float32"))
        _choice("train_dtype", self.train_dtype, ("bf16", "fp32"))
        _choice("select_mode", self.select_mode, ("tree", "chain"))
        _choice("layout", self.layout, ("vllm", "medusa"))
        _at_least(self, 1, "num_heads", "num_layers", "samples", "distill_tokens", "distill_batch", "steps",
                  "batch_size", "micro_batch_size", "eval_every", "eval_prompts", "eval_tokens", "draft_vocab",
                  "ttt_steps", "depth", "top_k", "draft_tokens")
        _at_least(self, 8, "max_len")
        try:
            self.train_config()
        except ValueError as err:  # the training loop's own rules (batch_size a multiple of micro_batch_size, ...)
            raise _Invalid("", str(err)) from None

    def train_config(self):
        """The ``TrainConfig`` these settings stand for."""
        from toolkit.heads.train import TrainConfig

        return TrainConfig(lr=self.lr, warmup_steps=self.warmup_steps, max_steps=self.steps,
                           batch_size=self.batch_size, micro_batch_size=self.micro_batch_size, dtype=self.train_dtype,
                           eval_every=self.eval_every, save_every=self.eval_every, seed=self.seed)


@dataclass(frozen=True)
class EvaluateSection:
    """``compound eval`` of the checkpoint against the model: windows × seq_len held-out tokens per slice, the
    generation checks (``generation``, ``generation_tokens`` decoded per prompt); prompts × new_tokens for the heads."""

    windows: int = 16
    seq_len: int = 512
    generation: bool = True
    generation_tokens: int = 96
    prompts: int = 8
    new_tokens: int = 64

    def __post_init__(self):
        _at_least(self, 1, "windows", "prompts", "new_tokens", "generation_tokens")
        _at_least(self, 2, "seq_len")


@dataclass(frozen=True)
class GatesSection:
    """Thresholds the run must meet before anything is pushed; None leaves a measure ungated.

    From ``eval.json`` (over all slices): max_perplexity_increase: quantized minus float perplexity;
    max_perplexity_ratio: their ratio; max_slice_perplexity_ratio: the ratio on the slice that degrades most; max_kl:
    mean KL(float ‖ quantized) in nats per token; min_top1_agreement: in [0, 1]. min_accepted_length: mean tokens per
    target forward in ``accepted_length_mode`` (chain: what vLLM serves; tree: compound's loop).
    """

    max_perplexity_increase: float | None = None
    max_perplexity_ratio: float | None = None
    max_slice_perplexity_ratio: float | None = None
    min_top1_agreement: float | None = None
    max_kl: float | None = None
    min_accepted_length: float | None = None
    accepted_length_mode: str = "chain"
    lossless_required: bool = True
    validate_required: bool = True

    def __post_init__(self):
        _choice("accepted_length_mode", self.accepted_length_mode, ("tree", "chain"))
        for key in ("max_perplexity_increase", "max_kl"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise _Invalid(key, f"must be >= 0, got {getattr(self, key)}")
        for key in ("max_perplexity_ratio", "max_slice_perplexity_ratio"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise _Invalid(key, f"must be >= 1 (quantized / float), got {getattr(self, key)}")
        if self.min_top1_agreement is not None and not 0 <= self.min_top1_agreement <= 1:
            raise _Invalid("min_top1_agreement", f"must be in [0, 1], got {self.min_top1_agreement}")
        if self.min_accepted_length is not None and self.min_accepted_length < 1:
            raise _Invalid("min_accepted_length", f"must be >= 1 (tokens per target forward), got "
                                                  f"{self.min_accepted_length}")


@dataclass(frozen=True)
class PushSection:
    """Where the artifacts go once every gate passed: the checkpoint to ``repo_id``, the heads to ``heads_repo_id``
    (default ``<repo_id>-medusa``). ``enabled: false`` never pushes; without a Hub token the push is skipped."""

    repo_id: str
    heads_repo_id: str | None = None
    enabled: bool = True
    private: bool = False
    revision: str | None = None
    tags: tuple[str, ...] = ()
    commit_message: str | None = None

    def __post_init__(self):
        for key in ("repo_id", "heads_repo_id"):
            value = getattr(self, key)
            if value is not None and (value.count("/") != 1 or "" in value.split("/")):
                raise _Invalid(key, f"must be owner/name, got {value!r}")

    @property
    def heads_repo(self) -> str:
        return self.heads_repo_id or f"{self.repo_id}-medusa"


@dataclass(frozen=True)
class Recipe:
    """One pipeline: a model, its sections (quantize, heads and push optional), and where its artifacts go."""

    name: str
    model: str
    output: Path
    calibration: CalibrationSection = field(default_factory=CalibrationSection)
    quantize: QuantizeSection | None = None
    heads: HeadsSection | None = None
    evaluate: EvaluateSection = field(default_factory=EvaluateSection)
    gates: GatesSection = field(default_factory=GatesSection)
    push: PushSection | None = None
    source: Path | None = None  # the file it was loaded from

    def __post_init__(self):
        if self.quantize is None and self.heads is None:
            raise _Invalid("", "a recipe needs a quantize or a heads section (or both)")
        gates = self.gates
        for key in ("max_perplexity_increase", "max_perplexity_ratio", "max_slice_perplexity_ratio", "min_top1_agreement",
                    "max_kl"):
            if getattr(gates, key) is not None and self.quantize is None:
                raise _Invalid(f"gates.{key}", "measures the quantized model, and the recipe has no quantize section")
        if gates.min_accepted_length is not None and self.heads is None:
            raise _Invalid("gates.min_accepted_length", "measures the heads, and the recipe has no heads section")

    @property
    def checkpoint(self) -> Path:
        return self.output / "checkpoint"

    @property
    def heads_dir(self) -> Path:
        return self.output / "heads"

    @property
    def heads_target(self) -> str:
        """The model the heads draft for: the quantized checkpoint when the recipe makes one (heads are trained
        against the model they serve), else the float model."""
        return str(self.checkpoint) if self.quantize else self.model


SECTIONS = {"calibration": CalibrationSection, "quantize": QuantizeSection, "heads": HeadsSection,
            "evaluate": EvaluateSection, "gates": GatesSection, "push": PushSection}
TOP_LEVEL = ("model", "output", *SECTIONS)


# ---- loading ------------------------------------------------------------------------------------------------------

def load_recipe(path: Path | str) -> Recipe:
    """Read and validate a recipe; every problem is a ``RecipeError`` naming the file, line and key: unknown keys
    (with the nearest valid one), wrong types, values out of range, sections the recipe's steps cannot use."""
    path = Path(path)
    try:
        loader = yaml.SafeLoader(path.read_text())
    except OSError as err:
        raise RecipeError(f"{path}: cannot read the recipe: {err.strerror}") from None
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise RecipeError(f"{path}:{mark.line + 1 if mark else 1}: not valid YAML: {getattr(err, 'problem', err)}") \
            from None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}

    def fail(key: str, message: str, line: int | None = None) -> RecipeError:
        line = line or next((lines[k] for k in (key, key.rpartition(".")[0]) if k in lines), 1)
        return RecipeError(f"{path}:{line}: {key + ': ' if key else ''}{message}")

    if not isinstance(data, dict):
        raise fail("", "a recipe is a mapping with model, calibration, quantize, heads, evaluate, gates, push")
    _index_lines(root, "", lines, fail)
    _refuse_unknown(data, TOP_LEVEL, "", fail)
    if not isinstance(data.get("model"), str):
        raise fail("model", "is required: an alias (smollm2-135m), a local directory, a .gguf file or a Hub id")
    sections = {name: _section(cls, data[name], name, fail) for name, cls in SECTIONS.items() if name in data}
    output = data.get("output", f"out/{path.stem}")
    if not isinstance(output, str):
        raise fail("output", f"expected a directory path, got {output!r}")
    try:
        return Recipe(name=path.stem, model=data["model"], output=Path(output), source=path, **sections)
    except _Invalid as err:
        raise fail(err.key, str(err)) from None


def _index_lines(node: yaml.Node, prefix: str, lines: dict[str, int], fail) -> None:
    """Record the line of every key path (``quantize.group_size``) and refuse a key given twice."""
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key in lines:
            raise fail(key, f"given twice (first on line {lines[key]})", line)
        lines[key] = line
        _index_lines(value_node, f"{key}.", lines, fail)


def _refuse_unknown(data: dict, known, prefix: str, fail) -> None:
    for key in data:
        if key not in known:
            near = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean {near[0]}?" if near else f"valid keys: {', '.join(known)}"
            raise fail(f"{prefix}{key}", f"unknown key; {hint}")


def _section(cls, data, name: str, fail):
    """Build section ``cls`` from its mapping, checking keys and types, then its own rules."""
    if not isinstance(data, dict):
        raise fail(name, f"expected a mapping of settings, got {data!r}")
    specs = fields(cls)
    _refuse_unknown(data, [f.name for f in specs], f"{name}.", fail)
    hints = typing.get_type_hints(cls)
    values = {}
    for spec in specs:
        if spec.name not in data:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise fail(name, f"{spec.name} is required")
            continue
        try:
            values[spec.name] = _typed(data[spec.name], hints[spec.name])
        except TypeError as err:
            raise fail(f"{name}.{spec.name}", str(err)) from None
    try:
        return cls(**values)
    except _Invalid as err:
        raise fail(f"{name}.{err.key}" if err.key else name, str(err)) from None


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _typed(value, hint):
    """``value`` as type ``hint`` (int, float, bool, str, X | None, tuple[str | int, ...]); TypeError naming both."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is tuple:
        element = typing.get_args(hint)[0]
        if isinstance(value, str) or not isinstance(value, list) or \
                not all(isinstance(v, element) and not isinstance(v, bool) for v in value):
            raise TypeError(f"expected a list of {'strings' if element is str else 'integers'}, got {value!r}")
        return tuple(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    ok = isinstance(value, hint) and not (hint is not bool and isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise TypeError(f"expected {_TYPE_NAMES[hint]}, got {value!r} ({type(value).__name__})")
    return value


# ---- steps and fingerprints ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Step:
    name: str
    inputs: dict  # the settings the step reads, resolved
    needs: tuple[str, ...]  # the steps whose outputs it reads
    outputs: tuple[Path, ...]  # files that must exist for a cached result to count
    run: Callable[[Recipe, Console], dict]  # reads its inputs from the recipe, its upstream steps' outputs from disk
    work: Path | None = None  # the step's own resumable state, kept only for the same fingerprint (``_prepare_work``)


def _plan(recipe: Recipe) -> list[_Step]:
    """The steps this recipe has, in order, with their resolved inputs (gates and push are handled by the run)."""
    cal, q, h, ev = recipe.calibration, recipe.quantize, recipe.heads, recipe.evaluate
    steps = []
    if q:
        needs_data = q.config(cal.seed).needs_activations or q.kv_cache is not None  # RTN alone reads no tokens
        steps += [
            _Step("quantize", {"quantize": asdict(q), "calibration": asdict(cal) if needs_data else None}, (),
                  (recipe.checkpoint / "compound.json",), _quantize),
            _Step("evaluate", {"dataset": cal.dataset, "windows": ev.windows, "seq_len": ev.seq_len,
                               "generation": ev.generation_tokens if ev.generation else None}, ("quantize",),
                  (recipe.output / "eval" / "eval.json",), _evaluate),
            _Step("validate", {"dataset": cal.dataset}, ("quantize",), (), _validate),
        ]
    if h:
        steps += [
            _Step("heads", {"heads": asdict(h), "dataset": cal.dataset}, ("quantize",) if q else (),
                  (recipe.heads_dir / "compound.json",), _heads, recipe.output / "heads.work"),
            _Step("heads_eval", {"prompts": ev.prompts, "new_tokens": ev.new_tokens}, ("heads",), (), _heads_eval),
        ]
    return steps


def step_fingerprints(recipe: Recipe) -> dict[str, str]:
    """SHA-256 per step of its resolved inputs, upstream fingerprints, model identity and compound version; push's
    reads every measuring step and the push section."""
    from toolkit.train_heads import target_identity

    model = target_identity(recipe.model)
    prints: dict[str, str] = {}

    def digest(name: str, inputs: dict, needs) -> str:
        payload = {"step": name, "inputs": inputs, "upstream": {n: prints[n] for n in needs}, "model": model,
                   "compound": __version__}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    for step in _plan(recipe):
        prints[step.name] = digest(step.name, step.inputs, step.needs)
    if recipe.push:
        prints["push"] = digest("push", asdict(recipe.push), tuple(prints))
    return prints


def _record_path(recipe: Recipe, step: str) -> Path:
    return recipe.output / ".steps" / f"{step}.json"


def _cached(recipe: Recipe, step: str, fingerprint: str, outputs=()) -> dict | None:
    """The stored record of ``step`` if it has ``fingerprint`` and its outputs exist, else None."""
    path = _record_path(recipe, step)
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("fingerprint") != fingerprint or not all(Path(p).exists() for p in outputs):
        return None
    return record


def _store(recipe: Recipe, step: str, fingerprint: str, inputs: dict, results: dict, seconds: float) -> None:
    path = _record_path(recipe, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"step": step, "fingerprint": fingerprint, "compound_version": __version__, "inputs": inputs,
              "seconds": seconds, "results": results}
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


def _quantize(recipe: Recipe, console: Console) -> dict:
    import torch

    from toolkit.quantize import CalibrationSpec, quantize

    q, cal = recipe.quantize, recipe.calibration
    console.print(f"quantizing {recipe.model}: {q.method} W{q.bits} g{q.group_size} → {recipe.checkpoint}")
    result = quantize(recipe.model, q.config(cal.seed), recipe.checkpoint,
                      CalibrationSpec(cal.dataset, cal.samples, cal.seq_len), fmt=q.format,
                      dtype=getattr(torch, q.dtype), overwrite=True, kv_cache=q.kv_cache,
                      kv_cache_strategy=q.kv_cache_strategy)
    size = sum(p.stat().st_size for p in recipe.checkpoint.rglob("*") if p.is_file())
    manifest = json.loads((recipe.checkpoint / "compound.json").read_text())
    return {"format": manifest["format"], "size_mib": size / 2**20, "peak_rss_mb": result.peak_rss_mb}


def _evaluate(recipe: Recipe, console: Console) -> dict:
    from toolkit.evaluate.generation import SETS
    from toolkit.evaluate.suite import evaluate

    ev = recipe.evaluate
    console.print(f"evaluating on up to {ev.windows}×{ev.seq_len} held-out tokens per slice of "
                  f"{recipe.calibration.dataset}" + (", with the generation checks" if ev.generation else ""))
    return evaluate(str(recipe.checkpoint), recipe.output / "eval", base=recipe.model,
                    dataset=recipe.calibration.dataset, windows=ev.windows, seq_len=ev.seq_len,
                    generation_sets=SETS if ev.generation else (), new_tokens=ev.generation_tokens, overwrite=True)


def _validate(recipe: Recipe, console: Console) -> dict:
    from toolkit.validate import validate

    console.print(f"validating {recipe.checkpoint}")
    return validate(recipe.checkpoint, dataset=recipe.calibration.dataset).to_dict()


def _heads(recipe: Recipe, console: Console) -> dict:
    from toolkit.train_heads import HeadsJob, train_heads

    h, target = recipe.heads, recipe.heads_target
    console.print(f"training {f'{h.num_heads} medusa heads' if h.type == 'medusa' else f'an {h.type} head'} "
                  f"against {target} → {recipe.heads_dir}")
    job = HeadsJob(model=target, output=recipe.heads_dir, head=h.type, num_heads=h.num_heads, num_layers=h.num_layers,
                   aux_layers=h.aux_layers, draft_vocab=h.draft_vocab, ttt_steps=h.ttt_steps, depth=h.depth,
                   top_k=h.top_k, draft_tokens=h.draft_tokens,
                   dataset=recipe.calibration.dataset, samples=h.samples, max_len=h.max_len,
                   distill_tokens=h.distill_tokens, distill_batch=h.distill_batch, dtype=h.dtype,
                   train=h.train_config(), eval_prompts=h.eval_prompts, eval_tokens=h.eval_tokens,
                   select_mode=h.select_mode, layout=h.layout, work_dir=recipe.output / "heads.work", overwrite=True)
    result = train_heads(job, console)
    return {"target": target, "examples": result.examples, "tokens": result.tokens, "best_step": result.best_step,
            "best_metrics": result.best_metrics}


def _heads_eval(recipe: Recipe, console: Console) -> dict:
    from toolkit.evaluate.acceptance import validate_heads

    ev = recipe.evaluate
    console.print(f"measuring the heads' accepted length on {ev.prompts} held-out prompts × {ev.new_tokens} tokens")
    reports = validate_heads(recipe.heads_target, recipe.heads_dir, ev.prompts, ev.new_tokens)
    return {r.mode: r.to_dict() for r in reports}


# ---- gates --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GateResult:
    """One threshold against its measured value."""

    name: str
    measured: float | bool
    op: str  # "<=", ">=" or "=="
    threshold: float | bool
    passed: bool

    def __str__(self) -> str:
        measured = f"{self.measured:.4g}" if isinstance(self.measured, float) else str(self.measured).lower()
        threshold = str(self.threshold).lower() if isinstance(self.threshold, bool) else f"{self.threshold:g}"
        return f"{self.name}: measured {measured}, threshold {self.op} {threshold}"


def check_gates(gates: GatesSection, results: dict[str, dict]) -> list[GateResult]:
    """Every gate that applies to the measured ``results`` (step name → results; absent steps have no gates)."""
    checks = []
    if "evaluate" in results:  # an eval.json report
        overall, worst = results["evaluate"]["overall"], results["evaluate"]["worst_slice"]
        checks += [("max_perplexity_increase", overall["perplexity"] - overall["base_perplexity"], "<="),
                   ("max_perplexity_ratio", overall["perplexity_ratio"], "<="),
                   ("max_slice_perplexity_ratio", results["evaluate"]["slices"][worst]["perplexity_ratio"], "<="),
                   ("min_top1_agreement", overall["top1_agreement"], ">="), ("max_kl", overall["kl"], "<=")]
    if "validate" in results and gates.validate_required:
        checks.append(("validate_required", results["validate"]["ok"], "=="))
    if "heads_eval" in results:
        he = results["heads_eval"]
        checks.append(("min_accepted_length", he[gates.accepted_length_mode]["mean_accepted_length"], ">="))
        if gates.lossless_required:
            checks.append(("lossless_required", all(r["lossless"] for r in he.values()), "=="))
    out = []
    for name, measured, op in checks:
        threshold = getattr(gates, name)
        if threshold is None:
            continue
        passed = {"<=": measured <= threshold, ">=": measured >= threshold, "==": measured == threshold}[op]
        label = f"{name} ({gates.accepted_length_mode})" if name == "min_accepted_length" else name
        out.append(GateResult(label, measured, op, threshold, bool(passed)))
    return out


# ---- the run ------------------------------------------------------------------------------------------------------

@dataclass
class StepSummary:
    """status: ran | cached | failed | skipped, or in a dry run: would run | cached."""

    name: str
    status: str
    seconds: float = 0.0
    fingerprint: str | None = None
    results: dict = field(default_factory=dict)
    note: str = ""


@dataclass
class RunSummary:
    """What a run did, step by step, and every gate it checked."""

    recipe: str
    output: Path
    steps: list[StepSummary] = field(default_factory=list)
    gates: list[GateResult] = field(default_factory=list)
    dry_run: bool = False

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates) and all(s.status != "failed" for s in self.steps)

    def step(self, name: str) -> StepSummary | None:
        """The summary of step ``name``, None if the run did not reach it."""
        return next((s for s in self.steps if s.name == name), None)

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "output": str(self.output), "passed": self.passed, "dry_run": self.dry_run,
                "steps": [asdict(s) for s in self.steps],
                "gates": [asdict(g) | {"text": str(g)} for g in self.gates]}


def run_recipe(recipe: Recipe, *, resume: bool = True, dry_run: bool = False, api=None,
               console: Console) -> RunSummary:
    """Run ``recipe``'s steps in order, skipping (with ``resume``) those whose fingerprint and outputs are unchanged,
    then check the gates and push when every gate passed and ``api`` (an ``HfApi``) is given.

    dry_run: print the plan (steps, fingerprints, which would be skipped) and touch nothing. Raises ``GateError``
    when a gate fails (nothing is pushed) and re-raises a failing step's error; either way the summary table is
    printed and, outside a dry run, written to ``<output>/summary.json``.
    """
    prints = step_fingerprints(recipe)
    summary = RunSummary(recipe.name, recipe.output, dry_run=dry_run)
    if dry_run:
        for step in _plan(recipe):
            cached = resume and _cached(recipe, step.name, prints[step.name], step.outputs)
            summary.steps.append(StepSummary(step.name, "cached" if cached else "would run",
                                             fingerprint=prints[step.name]))
        summary.steps.append(StepSummary("gates", "would run", note="always checked"))
        if recipe.push:
            status, note = ("would run", "if every gate passes and a Hub token is set") if recipe.push.enabled \
                else ("skipped", "disabled")
            if recipe.push.enabled and resume and _cached(recipe, "push", prints["push"]):
                status, note = "cached", "already pushed"
            summary.steps.append(StepSummary("push", status, fingerprint=prints["push"], note=note))
        console.print(summary_table(summary))
        return summary
    try:
        results: dict[str, dict] = {}
        for step in _plan(recipe):
            _run_step(recipe, step, prints[step.name], resume, console, summary)
            results[step.name] = summary.steps[-1].results
        summary.gates = check_gates(recipe.gates, results)
        failed = [g for g in summary.gates if not g.passed]
        note = f"{len(summary.gates) - len(failed)}/{len(summary.gates)} passed" + \
            (f"; failed: {', '.join(g.name for g in failed)}" if failed else "")
        summary.steps.append(StepSummary("gates", "failed" if failed else "ran", note=note))
        for gate in failed:
            console.print(f"[bold red]gate failed[/] {gate}")
        if failed:
            raise GateError(summary)
        if recipe.push:
            summary.steps.append(_push_step(recipe, prints["push"], results, api, resume, console))
    finally:
        recipe.output.mkdir(parents=True, exist_ok=True)
        (recipe.output / "summary.json").write_text(json.dumps(summary.to_dict(), indent=1, default=str) + "\n")
        console.print(summary_table(summary))
    return summary


def _run_step(recipe: Recipe, step: _Step, fingerprint: str, resume: bool, console: Console,
              summary: RunSummary) -> None:
    """Run or reuse ``step``, appending its summary (a failing step is appended as failed, then re-raised)."""
    record = _cached(recipe, step.name, fingerprint, step.outputs) if resume else None
    if record:
        console.print(f"[dim]{step.name}: cached ({fingerprint[:12]})[/]")
        summary.steps.append(StepSummary(step.name, "cached", 0.0, fingerprint, record["results"]))
        return
    _record_path(recipe, step.name).unlink(missing_ok=True)  # a record exists only beside complete outputs
    if step.work is not None:
        _prepare_work(step.work, fingerprint, resume)
    console.rule(f"{step.name} ({fingerprint[:12]})")
    started = time.perf_counter()
    try:
        results = step.run(recipe, console)
    except Exception as err:
        summary.steps.append(StepSummary(step.name, "failed", time.perf_counter() - started, fingerprint,
                                         note=f"{type(err).__name__}: {err}"))
        raise
    seconds = time.perf_counter() - started
    _store(recipe, step.name, fingerprint, step.inputs, results, seconds)
    summary.steps.append(StepSummary(step.name, "ran", seconds, fingerprint, results))


def _prepare_work(work: Path, fingerprint: str, resume: bool) -> None:
    """Keep a step's own resumable state (heads: data, hidden states, training checkpoints) only when it belongs to
    this fingerprint and the run resumes, so an interrupted training continues; otherwise start it empty."""
    stamp = work / "recipe-fingerprint"
    if work.exists() and not (resume and stamp.is_file() and stamp.read_text() == fingerprint):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(fingerprint)


def _push_step(recipe: Recipe, fingerprint: str, results: dict, api, resume: bool, console: Console) -> StepSummary:
    """Push the checkpoint and the heads, each to its repo; skipped when disabled or without a Hub client."""
    push = recipe.push
    if not push.enabled:
        return StepSummary("push", "skipped", fingerprint=fingerprint, note="disabled (push.enabled: false)")
    if api is None:
        console.print(f"[yellow]push skipped:[/] {NO_TOKEN}")
        return StepSummary("push", "skipped", fingerprint=fingerprint, note="no Hugging Face token")
    record = _cached(recipe, "push", fingerprint) if resume else None
    if record:
        console.print(f"[dim]push: cached, already pushed ({fingerprint[:12]})[/]")
        return StepSummary("push", "cached", 0.0, fingerprint, record["results"])
    from toolkit.hub import push as hub_push

    common = {"gates": {g.name: str(g).partition(": ")[2] for g in check_gates(recipe.gates, results)}}
    if recipe.source:
        common["command"] = f"compound run {recipe.source}"
    targets = []  # (directory, repo, the card's results in toolkit.hub's keys)
    if recipe.quantize:
        targets.append((recipe.checkpoint, push.repo_id, {"eval": results["evaluate"], **common}))
    if recipe.heads:
        targets.append((recipe.heads_dir, push.heads_repo, {"acceptance": list(results["heads_eval"].values()),
                                                           **common}))
    started = time.perf_counter()
    pushed = {}
    for directory, repo_id, card in targets:
        console.print(f"pushing {directory} → {repo_id}")
        result = hub_push(api, directory, repo_id, private=push.private, revision=push.revision, tags=list(push.tags),
                          commit_message=push.commit_message or f"compound run {recipe.name}", results=card)
        pushed[repo_id] = asdict(result)
    seconds = time.perf_counter() - started
    _store(recipe, "push", fingerprint, asdict(push), pushed, seconds)
    return StepSummary("push", "ran", seconds, fingerprint, pushed)


def _key_numbers(step: StepSummary) -> str:
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


def summary_table(summary: RunSummary) -> Table:
    """The Rich table of a run (or, for a dry run, of its plan): step, status, seconds, key numbers."""
    table = Table(title=f"compound run {summary.recipe}{' (dry run)' if summary.dry_run else ''} → {summary.output}")
    for column in ("step", "status", "fingerprint" if summary.dry_run else "seconds", "key numbers"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    colours = {"ran": "green", "cached": "cyan", "failed": "bold red", "skipped": "yellow", "would run": "magenta"}
    for s in summary.steps:
        third = (s.fingerprint or "-")[:12] if summary.dry_run else f"{s.seconds:.1f}"
        table.add_row(s.name, f"[{colours[s.status]}]{s.status}[/]", third, _key_numbers(s))
    return table
