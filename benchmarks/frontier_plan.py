"""The runs of ``benchmarks/frontier.py``: which tools, methods, rotations, peers and settings run on each model at
each precision, as its options select them, and the compound config of each run.

A run is one row of the frontier's tables (``Run``): a tool's method, its rotation, learned rounding's iterations and
at most one changed setting. The option parsers here exit 2 with one line naming the flag on a bad value.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

MODELS = ("smollm2-135m", "gemma3-270m")
PRECISIONS = {"w4g64": (4, 64), "w3g64": (3, 64), "w4g128": (4, 128)}
METHODS = ("rtn", "gptq", "awq", "awq+gptq", "signround")
PEERS = ("autoround", "autoround-defaults", "autoround-iters0", "gptqmodel", "llmcompressor", "llmcompressor-hadamard",
         "llmcompressor-random-hadamard")
AUTOROUND_DEFAULT_ITERS = 200  # AutoRound 0.16's steps per block at its defaults (``autoround-defaults``)
SPINQUANT = {"llmcompressor-hadamard": "hadamard", "llmcompressor-random-hadamard": "random-hadamard"}


@dataclass(frozen=True)
class Run:
    """One row: a tool's method on one model at one precision. ``iters``: learned rounding's steps (SignRound,
    AutoRound); ``change``: the one setting changed from the method's defaults (field → value; ``samples`` is the
    calibration's, ``batch_size`` the quantize run's, ``RUN_SETTINGS``): in --defaults mode, and for the float-targets
    and batch-size variants of the frontier."""

    tool: str
    method: str
    rotate: str = "none"
    iters: int | None = None
    change: tuple[tuple[str, object], ...] = ()

    @property
    def name(self) -> str:
        """The run's directory name and the row's label."""
        parts = [self.tool, self.method.replace("+", "-")]
        parts += [f"rot-{self.rotate}"] if self.rotate != "none" else []
        parts += [f"iters{self.iters}"] if self.iters is not None else []
        parts += [f"{k.replace('_', '-')}-{v}" for k, v in self.change]
        return "_".join(parts)

    @property
    def label(self) -> str:
        """The method as the main table names it: iterations and a changed setting in brackets."""
        return self.method + "".join(f" ({x})" for x in ([f"{self.iters} iters"] if self.iters is not None else [])
                                     + ([self.setting] if self.change else []))

    @property
    def setting(self) -> str:
        """The changed setting as the table shows it ("defaults" when none is)."""
        return ", ".join(SETTING_LABELS[k](v) for k, v in self.change) or "defaults"


SETTING_LABELS = {  # --defaults: how the table names each changed setting
    "sym": lambda sym: "symmetric grid" if sym else "asymmetric grid",
    "act_order": lambda on: f"act-order {'on' if on else 'off'}",
    "mse_clip": lambda on: "range search" if on else "min/max ranges",
    "samples": lambda n: f"{n} calibration samples",
    "group_size": lambda g: f"group size {g}",
    "float_targets": lambda on: "float targets" if on else "own weights",
    "batch_size": lambda n: f"batch {n}",
    "refit_rounds": lambda n: f"{n} scale refits",
}
REFIT_ROUNDS = 3  # --refit-methods' GPTQ refit_rounds: three refits, GPTQ choosing the codes again between two
RUN_SETTINGS = ("samples", "batch_size")  # changes of the run (calibration, QuantizeSettings), not of the method config


def parse_list(text: str, choices: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated option's values, each checked against ``choices`` (exit 2 naming the flag otherwise)."""
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if v not in choices]
    if bad:
        print(f"error: {flag}: unknown {', '.join(bad)}; choose from {', '.join(choices)}", file=sys.stderr)
        raise SystemExit(2)
    return values


def parse_counts(text: str, flag: str) -> list[int]:
    """A comma-separated option's positive integers (exit 2 naming the flag otherwise)."""
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if not v.isdigit() or int(v) < 1]
    if bad:
        print(f"error: {flag}: {', '.join(bad)} is not a positive integer", file=sys.stderr)
        raise SystemExit(2)
    return [int(v) for v in values]


def parse_skips(text: str) -> set[tuple[str, str]]:
    """``--skip``'s MODEL:METHOD, MODEL:METHOD@ROTATION (that method's rotated run only) and MODEL:PEER pairs; exit 2
    on an unknown model, method, rotation or peer."""
    from toolkit.quant.configs import ROTATIONS

    rotated = tuple(f"{m}@{r}" for m in METHODS for r in ROTATIONS if r != "none")
    pairs = [tuple(item.split(":", 1)) if ":" in item else (item, "") for item in text.split(",") if item]
    bad = [":".join(p) for p in pairs if p[0] not in MODELS or p[1] not in (*METHODS, *rotated, *PEERS)]
    if bad:
        print(f"error: --skip: unknown {', '.join(bad)}; write MODEL:METHOD, MODEL:METHOD@ROTATION or MODEL:PEER "
              f"with a model of {', '.join(MODELS)}, a method of {', '.join(METHODS)}, a rotation of "
              f"{', '.join(r for r in ROTATIONS if r != 'none')} or a peer of {', '.join(PEERS)}", file=sys.stderr)
        raise SystemExit(2)
    return set(pairs)


def widths(float_dir: Path) -> dict[str, int]:
    """The input widths of the model's quantized linears, by the role that reads them."""
    config = json.loads((float_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {"hidden": config["hidden_size"], "intermediate": config["intermediate_size"],
            "attention output": config["num_attention_heads"] * head_dim}


def skipped(float_dir: Path, group_size: int) -> str | None:
    """Why ``group_size`` cannot quantize this model (a width it does not divide), or None."""
    bad = {role: w for role, w in widths(float_dir).items() if w % group_size}
    return ", ".join(f"{w} ({role}) % {group_size} = {w % group_size}" for role, w in bad.items()) or None


def frontier_runs(args, model: str) -> list[Run]:
    """compound's methods × rotations (float targets and scale refits with each rotation, the other variants
    unrotated), then the peers' runs, as the options select them, less ``--skip``'s methods, rotated runs and peers
    on ``model``."""
    rotated = {m: [(("float_targets", True),)] * (m in args.float_targets_methods)
               + [(("refit_rounds", REFIT_ROUNDS),)] * (m in args.refit_methods) for m in args.methods}
    changes = {m: [()] + rotated[m] + [(("mse_clip", False),)] * (m in args.min_max_methods)
               + [(("batch_size", n),) for n in args.signround_batch_sizes] * (m == "signround") for m in args.methods}
    runs = [Run("compound", m, r, args.iters if m == "signround" else None, change) for m in args.methods
            if (model, m) not in args.skip for r in args.rotations
            if r == "none" or (m in args.rotated_methods and (model, f"{m}@{r}") not in args.skip)
            for change in (changes[m] if r == "none" else [(), *rotated[m]])]
    for peer in (p for p in args.peers if (model, p) not in args.skip):
        if peer == "autoround":
            runs.append(Run("autoround", "signround", iters=args.iters))
        elif peer == "autoround-defaults":
            runs.append(Run("autoround", "signround", iters=AUTOROUND_DEFAULT_ITERS))
        elif peer == "autoround-iters0":
            runs.append(Run("autoround", "signround", iters=0))
        elif peer in SPINQUANT:  # SpinQuant's R1+R2 rotations, then GPTQ
            runs += [Run("llmcompressor", "gptq", SPINQUANT[peer])] if "gptq" in args.methods else []
        else:
            runs += [Run(peer, m) for m in ("gptq", "awq") if m in args.methods]
    return list(dict.fromkeys(runs))  # autoround and autoround-defaults are one run when --iters is the default


def defaults_runs(args, float_dir: Path, bits: int) -> list[Run]:
    """compound's methods at their defaults, then each with one setting changed: the grid, act-order (methods that
    reorder columns), GPTQ's range search (methods with a Hessian), calibration samples (methods that calibrate) and the group size (those that divide every
    width); a change that equals the default is left out."""
    from toolkit.quant.configs import METHODS as CONFIGS
    from toolkit.quant.configs import STANDARD_GROUP_SIZES, make_config

    runs = []
    for method in args.methods:
        default = make_config(method, bits=bits)
        changes = [("sym", not default.sym)]
        if CONFIGS[method].reorders_columns:
            changes.append(("act_order", not default.act_order))
        if CONFIGS[method].needs_hessian:
            changes.append(("mse_clip", not default.mse_clip))
        if CONFIGS[method].needs_activations:
            changes += [("samples", n) for n in args.default_samples if n != args.calib_samples]
        fitted = default.fitted(widths(float_dir))[0].group_size  # the group size compound would choose
        changes += [("group_size", g) for g in sorted(STANDARD_GROUP_SIZES) if g != fitted
                    and not skipped(float_dir, g)]
        iters = args.iters if method == "signround" else None
        runs += [Run("compound", method, iters=iters)] + [Run("compound", method, iters=iters, change=(c,))
                                                          for c in changes]
    return runs


def compound_config(run: Run, bits: int, group_size: int | None, grid: str | None):
    """The method config of a compound run on ``grid`` (one of ``GRIDS``); ``group_size`` / ``grid`` None: the
    method's default."""
    from toolkit.quant.configs import make_config

    sym = None if grid is None else grid != "asym"
    options = {"bits": bits, "group_size": group_size, "sym": sym, "full_range": grid == "full", "rotate": run.rotate,
               "iters": run.iters}
    options.update((k, v) for k, v in run.change if k not in RUN_SETTINGS)
    return make_config(run.method, **options)
