"""Quality at the frontier: compound's RTN / GPTQ / AWQ / AWQ+GPTQ / SignRound, each with and without
``--rotate hadamard``, against AutoRound, GPTQModel and llm-compressor on both embedded real models (SmolLM2-135M-
Instruct, Gemma-3 270M) at W4 g64, W3 g64 and W4 g128 (where 128 divides every width: Gemma's 640, not SmolLM2's 576).

Every tool quantizes the same float32 checkpoint (``benchmarks/peers/export_float.py``) on the same calibration tokens
(one file; compound's own, rebuilt from the same spec, is checked against it by fingerprint) in its own process (peers
in their own venvs, made by ``benchmarks/peers/setup.sh``) under ``/usr/bin/time`` for wall
time and peak RSS. compound's evaluator then scores every result against the float model on the same held-out
windows: KL divergence and top-1 agreement first (perplexity on text like the calibration data flatters a method
that drifts toward it), on ShareGPT's eval split and on text unlike it (the code and non-English eval slices,
``toolkit.evaluate.slices``), then perplexity. A run that fails keeps its row, with the tool's own last message.

    python benchmarks/frontier.py [--models smollm2-135m,gemma3-270m] [--precisions w4g64,w3g64,w4g128]
        [--methods rtn,gptq,awq,awq+gptq,signround] [--rotations none,hadamard] [--rotated-methods rtn,...]
        [--float-targets-methods gptq,awq+gptq] [--refit-methods gptq,awq+gptq] [--min-max-methods gptq,awq+gptq]
        [--signround-batch-sizes 4]
        [--peers autoround,autoround-defaults,autoround-iters0,gptqmodel,llmcompressor,llmcompressor-hadamard,
                 llmcompressor-random-hadamard]
        [--calib-samples 128] [--seq-len 512] [--iters 200] [--grid asym|sym|full] [--reuse] [--no-write]
    python benchmarks/frontier.py --defaults [--default-samples 32,128,512] ...   # compound's defaults, measured

``--grid sym`` and ``--grid full`` write a section each (compound stores 3-bit weights only symmetric, in the GPTQ
layout, so its asymmetric W3 rows fail with that message; AutoRound's own default grid is symmetric over the full code
range). ``full`` is compound's ``--full-range``; the peers get their symmetric grid either way. ``autoround`` runs
AutoRound at ``--iters``, ``autoround-defaults`` at its own default 200, whatever ``--iters`` is. A failed or missing
row is rerun by the same command with ``--reuse``: every finished run and score is taken from the cache, the rest is
run.

``--defaults`` measures compound alone, one setting at a time from each method's defaults: the grid (sym / asym),
act-order (on / off, GPTQ's), GPTQ's range search (on / off), calibration samples and group size, at the first
precision's bits, on each model; it writes its own section. Runs, scores and logs are kept under benchmarks/.cache/frontier/<model>/<precision>-<settings>.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import quantize_argv  # noqa: E402
from frontier_plan import (  # noqa: E402
    AUTOROUND_DEFAULT_ITERS,
    METHODS,
    MODELS,
    PEERS,
    PRECISIONS,
    Run,
    compound_config,
    defaults_runs,
    frontier_runs,
    parse_counts,
    parse_list,
    parse_skips,
    skipped,
)
from report import command_line, cpu_name, markdown_table, update_section  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache"
VENVS = ROOT / "benchmarks" / ".venvs"
UNLIKE = ("code", "non-english")  # the eval slices least like ShareGPT's prose
# issue #38: perplexity within × of float, on ShareGPT only or on the code/non-English text too
GOALS = {("smollm2-135m", "w4g64"): (1.05, False), ("gemma3-270m", "w4g64"): (1.08, True)}
TITLE = "Quality at the frontier: compound vs AutoRound, GPTQModel, llm-compressor"
DEFAULTS_TITLE = "Defaults from measurement"
SECTION_SAMPLES = 32  # the calibration sequences of the frontier's main sections; other counts write their own
SECTION_GROUP_SIZE = 64  # the group size of the frontier's main sections; other sizes write their own


GRIDS = {  # --grid: what each tool gets
    "asym": "asymmetric for every tool",
    "sym": "symmetric for every tool (GPTQ's grid for compound, GPTQModel and llm-compressor: ±amax half a step inside "
           "the codes; AutoRound's over the full code range)",
    "full": "symmetric over the full code range for compound (--full-range) and AutoRound (its own symmetric grid), "
            "GPTQ's symmetric grid for GPTQModel and llm-compressor",
}
SECTION_SUFFIXES = {"asym": "", "sym": " (symmetric grid)", "full": " (symmetric full-range grid)"}
def calibration_file(tokenizer, args, samples: int, model: str) -> tuple[Path, str]:
    """The calibration tokens every tool reads (built once per spec), and their fingerprint."""
    import torch

    from toolkit.calibration import calibration_batch, fingerprint

    path = CACHE / "frontier" / model / f"calib_{samples}x{args.seq_len}.pt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(calibration_batch(tokenizer, "sharegpt", samples, args.seq_len, seed=0), path)
    return path, fingerprint(torch.load(path, weights_only=True))


def last_message(log: Path) -> str:
    """A failed run's own last word: the last line of its log that names an error, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^(\w+\.)*\w*(Error|Exception|Exit)\b|^error\b|^ERROR", line)]
    return (errors or lines or ["(no output)"])[-1][:300]


def run_one(run: Run, args, model: str, float_dir: Path, precision: tuple[int, int] | None, calib: Path,
            fingerprint: str, runs_dir: Path) -> dict:
    """Quantize with ``run`` (or reuse its finished result): a dict with the result's directory and whether it is
    compound's packed checkpoint (else a peer's dequantized copy), or the failure's message; wall seconds and peak
    RSS MiB either way."""
    from quantize_vs_peers import recorded, timed

    from toolkit.engine.threads import ThreadSettings
    from toolkit.quantize import CalibrationSpec, QuantizeSettings

    out, log = runs_dir / run.name, runs_dir / f"{run.name}.log"
    if run.tool == "compound":
        bits, group_size = precision or (args.defaults_bits, None)
        grid = None if precision is None else args.grid
        samples = dict(run.change).get("samples", args.calib_samples)
        done = out / "config.json"  # written last, by the atomic rename of the checkpoint
        command = quantize_argv(compound_config(run, bits, group_size, grid),
                                CalibrationSpec(samples=samples, seq_len=args.seq_len),
                                QuantizeSettings(**{k: v for k, v in run.change if k == "batch_size"}),
                                ThreadSettings(threads=str(args.threads)), model=float_dir, output=out)
    else:
        bits, group_size = precision
        done = out / "result.json"  # the runner writes it last, after the dequantized copy
        python = VENVS / run.tool / "bin" / "python"
        if not python.exists():
            return {"failed": f"no venv: run bash benchmarks/peers/setup.sh {run.tool}"}
        command = [str(python), str(ROOT / "benchmarks" / "peers" / f"run_{run.tool}.py"), "--model", str(float_dir),
                   "--calib", str(calib), "--method", run.method, "--bits", str(bits), "--group-size",
                   str(group_size), "--out", str(out), "--threads", str(args.threads), "--rotate", run.rotate]
        command += ["--asym"] if args.grid == "asym" else []
        command += ["--act-order"] if run.method == "gptq" and args.act_order else []
        command += ["--iters", str(run.iters)] if run.iters is not None else []
    if not (args.reuse and done.exists()):
        print(f"$ {' '.join(map(str, command))}", flush=True)
        try:
            timed(command, log)
        except subprocess.CalledProcessError:
            seconds, rss = recorded(log)
            return {"failed": last_message(log), "seconds": seconds, "peak_rss_mib": rss}
    seconds, rss = recorded(log)
    if run.tool == "compound":
        recorded_calib = json.loads((out / "compound.json").read_text()).get("calibration") or {}
        if recorded_calib.get("fingerprint") not in (None, fingerprint):
            raise SystemExit(f"{out}: compound calibrated on other tokens than {calib} (fingerprints differ)")
        return {"dir": out, "quantized": True, "seconds": seconds, "peak_rss_mib": rss}
    return {"dir": out / "dequantized", "quantized": False, "seconds": seconds, "peak_rss_mib": rss}


def score(result: dict, base, held_out: dict, args) -> dict:
    """KL, top-1 agreement and perplexity against the float model on each held-out set (cached beside the run)."""
    from toolkit.evaluate.divergence import divergence
    from toolkit.models import load_model
    from toolkit.runtime.load import load_quantized

    cached = Path(str(result["dir"]) + f".score-{args.windows}-{args.slice_windows}x{args.seq_len}.json")
    if args.reuse and cached.is_file():
        return json.loads(cached.read_text())
    model = load_quantized(result["dir"])[0] if result["quantized"] else load_model(str(result["dir"]))
    scores = {}
    for name, windows in held_out.items():
        d = divergence(model, base, windows, batch_size=1)  # one window at a time: Gemma's 262k-token logits
        scores[name] = {k: v for k, v in vars(d).items() if k not in ("kl_counts", "window_nll", "base_window_nll")}
    partial = cached.with_name(cached.name + ".partial")
    partial.write_text(json.dumps(scores, indent=2))
    partial.replace(cached)  # whole or absent: a killed run leaves no half-written score to reuse
    return scores


def held_out_sets(tokenizer, args) -> dict:
    """The same windows for every run: ShareGPT's eval split, and its code and non-English slices together."""
    import torch

    from toolkit.calibration import eval_windows
    from toolkit.evaluate.slices import slice_windows

    unlike = slice_windows(tokenizer, windows=args.slice_windows, seq_len=args.seq_len, slices=UNLIKE)
    return {"sharegpt": eval_windows(tokenizer, "sharegpt", args.windows, args.seq_len),
            "unlike": torch.cat([unlike[name] for name in UNLIKE])}


def row(run: Run, result: dict, defaults: bool) -> list[str]:
    """A table row: who and how, cost, then fidelity (KL, top-1) before perplexity."""
    who = [run.setting] if defaults else [run.tool, run.label, run.rotate]
    cost = [f"{result['seconds']:.0f}" if "seconds" in result else "–",
            f"{result['peak_rss_mib']:.0f}" if "peak_rss_mib" in result else "–"]
    if "failed" in result:
        return [*who, *cost, f"failed: `{result['failed']}`", *["–"] * 6]
    s, u = result["scores"]["sharegpt"], result["scores"]["unlike"]
    return [*who, *cost, f"{s['kl']:.4f}", f"{s['top1_agreement']:.1%}", f"{u['kl']:.4f}",
            f"{u['top1_agreement']:.1%}", f"{s['perplexity']:.3f}", f"+{s['perplexity'] - s['base_perplexity']:.3f}",
            f"×{u['perplexity'] / u['base_perplexity']:.3f}"]


COLUMNS = ["wall s", "peak RSS MiB", "KL", "top-1", "KL code/non-En", "top-1 code/non-En", "perplexity",
           "Δ vs float", "code/non-En ppl vs float"]


def findings(model: str, precision: str, rows: list[tuple[Run, dict]]) -> list[str]:
    """The issue's goals read off one table: compound's lowest-KL run against AutoRound (each of its runs that
    learned) in KL, perplexity against float (on both held-out sets) and wall time."""
    ok = [(run, r) for run, r in rows if "scores" in r]
    mine = [(run, r) for run, r in ok if run.tool == "compound"]
    if not mine:
        return []
    run, best = min(mine, key=lambda item: item[1]["scores"]["sharegpt"]["kl"])
    s, u = best["scores"]["sharegpt"], best["scores"]["unlike"]
    ratio, unlike_ratio = s["perplexity"] / s["base_perplexity"], u["perplexity"] / u["base_perplexity"]
    line = (f"- {model} {precision}: compound's lowest KL is {run.label} (rotate {run.rotate}), KL {s['kl']:.4f}, "
            f"perplexity ×{ratio:.3f} of float (×{unlike_ratio:.3f} on code/non-English)")
    if (model, precision) in GOALS:
        goal, unlike_too = GOALS[model, precision]
        worst = max(ratio, unlike_ratio) if unlike_too else ratio
        line += (f"; goal ×{goal:.2f} ({'both held-out sets' if unlike_too else 'ShareGPT'}): "
                 f"{'met' if worst <= goal else f'missed by {worst - goal:.3f}'}")
    for peer, result in sorted(((p, r) for p, r in ok if p.tool == "autoround" and p.iters),
                               key=lambda item: item[0].iters):
        kl = result["scores"]["sharegpt"]["kl"]
        default = ", its default" if peer.iters == AUTOROUND_DEFAULT_ITERS else ""
        line += (f"; AutoRound ({peer.iters} iters{default}) KL {kl:.4f}: compound's is "
                 f"{'lower' if s['kl'] < kl else 'higher'} by {abs(s['kl'] - kl) / kl:.1%}, its wall "
                 f"{best['seconds']:.0f} s against AutoRound's {result['seconds']:.0f} s "
                 f"(×{best['seconds'] / result['seconds']:.2f}, goal ≤ ×0.50)")
    return [line]


def defaults_findings(model: str, rows: list[tuple[Run, dict]]) -> list[str]:
    """Per method and setting: the value with the lowest KL, against the method's default."""
    lines = []
    for method in dict.fromkeys(run.method for run, _ in rows):
        mine = [(run, r) for run, r in rows if run.method == method and "scores" in r]
        base = next((r for run, r in mine if not run.change), None)
        for knob in dict.fromkeys(run.change[0][0] for run, _ in mine if run.change):
            options = [(run.setting, r) for run, r in mine if run.change and run.change[0][0] == knob]
            options += [("the default", base)] if base else []
            best, r = min(options, key=lambda item: item[1]["scores"]["sharegpt"]["kl"])
            kl = r["scores"]["sharegpt"]["kl"]
            name = "grid" if knob == "sym" else knob.replace("_", " ")
            line = f"- {model} {method}, {name}: lowest KL at {best} ({kl:.4f}"
            line += f"; the default's {base['scores']['sharegpt']['kl']:.4f})" if base and r is not base else ")"
            lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="bits and group size: w4g64, w3g64, w4g128")
    parser.add_argument("--methods", default=",".join(METHODS), help="compound's methods (and the peers' GPTQ / AWQ)")
    parser.add_argument("--rotations", default="none,hadamard", help="compound's --rotate values")
    parser.add_argument("--min-max-methods", default="", help="the methods also run unrotated with each group's "
                        "min/max range (--no-mse-clip) instead of GPTQ's range search (gptq, awq+gptq)")
    parser.add_argument("--float-targets-methods", default="", help="the methods also run with GPTQ's "
                        "--float-targets (gptq, awq+gptq), unrotated and with each rotation --rotated-methods gives them")
    parser.add_argument("--refit-methods", default="", help="the methods also run with GPTQ's --refit-rounds "
                        "(gptq, awq+gptq), unrotated and with each rotation --rotated-methods gives them")
    parser.add_argument("--signround-batch-sizes", default="", help="compound's SignRound also run unrotated with "
                        "each of these calibration batch sizes (sequences per learning step; default 8, AutoRound's)")
    parser.add_argument("--rotated-methods", default=",".join(METHODS), help="the methods also run with each "
                        "rotation other than none (default: every method)")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--skip", default="", help="MODEL:METHOD, MODEL:METHOD@ROTATION or MODEL:PEER,...: "
                        "compound's METHOD, its rotated run or the PEER not run on MODEL (e.g. "
                        "gemma3-270m:signround,gemma3-270m:gptq@hadamard,gemma3-270m:autoround-defaults)")
    parser.add_argument("--grid", default="asym", choices=tuple(GRIDS), help="the grid every tool gets")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--iters", type=int, default=AUTOROUND_DEFAULT_ITERS, help="SignRound's and AutoRound's "
                        f"steps per block ({AUTOROUND_DEFAULT_ITERS}: both tools' default; the autoround-defaults peer "
                        "runs AutoRound at it whatever this is)")
    parser.add_argument("--windows", type=int, default=80, help="ShareGPT held-out windows")
    parser.add_argument("--slice-windows", type=int, default=16, help="held-out windows per unlike slice "
                        "(code, non-English)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="every tool's threads")
    parser.add_argument("--defaults", action="store_true", help="measure compound's defaults instead (see above)")
    parser.add_argument("--default-samples", default="32,128,512", help="--defaults: calibration samples tried")
    parser.add_argument("--reuse", action="store_true", help="take finished runs and scores from the cache")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    from toolkit.quant.configs import ROTATIONS, GPTQConfig

    args.models = parse_list(args.models, MODELS, "--models")
    args.precisions = parse_list(args.precisions, tuple(PRECISIONS), "--precisions")
    args.methods = parse_list(args.methods, METHODS, "--methods")
    args.rotations = parse_list(args.rotations, ROTATIONS, "--rotations")
    args.rotated_methods = parse_list(args.rotated_methods, METHODS, "--rotated-methods")
    args.float_targets_methods = parse_list(args.float_targets_methods, ("gptq", "awq+gptq"),
                                            "--float-targets-methods")
    args.refit_methods = parse_list(args.refit_methods, ("gptq", "awq+gptq"), "--refit-methods")
    args.min_max_methods = parse_list(args.min_max_methods, ("gptq", "awq+gptq"), "--min-max-methods")
    args.peers = parse_list(args.peers, PEERS, "--peers")
    args.skip = parse_skips(args.skip)
    args.default_samples = parse_counts(args.default_samples, "--default-samples")
    args.signround_batch_sizes = parse_counts(args.signround_batch_sizes, "--signround-batch-sizes")
    args.act_order = next(f.default for f in dataclasses.fields(GPTQConfig) if f.name == "act_order")
    args.defaults_bits = PRECISIONS[args.precisions[0]][0]
    report(args, {model: measure(model, args) for model in args.models})


def measure(model: str, args) -> dict[str, list[tuple[Run, dict]] | str]:
    """Every selected run on ``model``, scored: precision (or "defaults") → [(run, result)], or why it was skipped."""
    from toolkit.models import load_model, load_tokenizer

    float_dir = CACHE / f"{model}-hf"
    if not (float_dir / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "export_float.py"), "--model", model],
                       check=True, cwd=ROOT)
    tokenizer = load_tokenizer(str(float_dir))
    calib = {n: calibration_file(tokenizer, args, n, model)
             for n in {args.calib_samples, *(args.default_samples if args.defaults else ())}}
    tag = f"{args.calib_samples}x{args.seq_len}" + ("" if args.defaults else f"-{args.grid}")
    plans: dict[str, tuple[list[Run], tuple[int, int] | None] | str] = {}
    if args.defaults:
        plans["defaults"] = (defaults_runs(args, float_dir, args.defaults_bits), None)
    else:
        for precision in args.precisions:
            why = skipped(float_dir, PRECISIONS[precision][1])
            plans[precision] = f"skipped: {why}" if why else (frontier_runs(args, model), PRECISIONS[precision])
    results: dict[str, list[tuple[Run, dict]] | str] = {}
    for key, plan in plans.items():
        if isinstance(plan, str):
            results[key] = plan
            continue
        runs, precision = plan
        runs_dir = CACHE / "frontier" / model / f"{key}-{tag}"
        runs_dir.mkdir(parents=True, exist_ok=True)
        results[key] = []
        for run in runs:
            path, fingerprint = calib[dict(run.change).get("samples", args.calib_samples)]
            results[key].append((run, run_one(run, args, model, float_dir, precision, path, fingerprint, runs_dir)))
    held_out = held_out_sets(tokenizer, args)
    base = load_model(str(float_dir))
    for key, rows in results.items():
        for run, result in rows if isinstance(rows, list) else []:
            if "failed" not in result:
                try:
                    result["scores"] = score(result, base, held_out, args)
                except Exception as err:  # a result that does not load or score is that run's failure
                    result["failed"] = f"scoring: {type(err).__name__}: {err}"[:300]
    results["_tokens"] = {name: int(w.shape[0] * (w.shape[1] - 1)) for name, w in held_out.items()}
    return results


def report(args, measured: dict) -> None:
    """Print the tables and findings; write them into BENCHMARKS.md unless --no-write."""
    defaults = args.defaults
    who = ["setting"] if defaults else ["tool", "method", "rotate"]
    parts, lines = [], []
    for model, results in measured.items():
        tokens = results.pop("_tokens")
        for key, rows in results.items():
            heading = f"**{model}, {f'W{args.defaults_bits} defaults' if defaults else key}**"
            if isinstance(rows, str):
                parts.append(f"{heading}: {rows}")
                continue
            if defaults:
                for method in dict.fromkeys(run.method for run, _ in rows):
                    mine = [(run, r) for run, r in rows if run.method == method]
                    parts.append(f"{heading}, {method}:\n\n" + markdown_table(
                        who + COLUMNS, [row(run, r, True) for run, r in mine]))
                lines += defaults_findings(model, rows)
            else:
                parts.append(f"{heading}:\n\n" + markdown_table(who + COLUMNS, [row(run, r, False) for run, r in rows]))
                lines += findings(model, key, rows)
        parts[-1] += (f"\n\nHeld-out tokens scored on {model}: {tokens['sharegpt']} ShareGPT, {tokens['unlike']} "
                      "code/non-English.")
    threads = f"{args.threads} thread{'s' if args.threads != 1 else ''}"
    settings = (f"Command: `{command_line()}`\n\nOn {cpu_name()}, {threads} per tool. Calibration: "
                f"{args.calib_samples}×{args.seq_len} ShareGPT tokens, the same file for every tool"
                f"{' (and ' + ', '.join(map(str, args.default_samples)) + ' samples where varied)' if defaults else ''}"
                f". Held-out: {args.windows}×{args.seq_len} ShareGPT eval windows, and up to {args.slice_windows} "
                f"windows each of its code and non-English slices (text unlike the calibration data). "
                + ("Each method at its defaults, then one setting changed at a time." if defaults else
                   f"Grid: {GRIDS[args.grid]}; GPTQ act-order {'on' if args.act_order else 'off'} "
                   f"(static groups) for every tool; SignRound and AutoRound {args.iters} iterations"
                   + (f" (AutoRound also at its default {AUTOROUND_DEFAULT_ITERS})"
                      if "autoround-defaults" in args.peers and args.iters != AUTOROUND_DEFAULT_ITERS else "")
                   + "; llm-compressor's "
                   "rotation: SpinQuant R1+R2 with its Hadamard transform (deterministic: powers of two only) or "
                   "its random one.")
                + " KL: mean KL(float ‖ quantized) per token in nats; Δ and the ratio: perplexity against the float "
                "model's on the same windows. Both models' float weights were dequantized from GGUF (SmolLM2 from "
                "Q4_1, Gemma-3 from Q4_K_M), which flatters an asymmetric grid at small group sizes.")
    body = "\n\n".join([settings, *parts, "\n".join(lines)])
    print(body)
    (CACHE / ("frontier_defaults.json" if defaults else "frontier.json")).write_text(json.dumps(
        {m: {k: [{"run": dataclasses.asdict(run), **{x: y for x, y in r.items() if x != "dir"}} for run, r in rows]
             if isinstance(rows, list) else rows for k, rows in results.items()} for m, results in measured.items()},
        indent=2, default=str))
    if not args.no_write:
        update_section(DEFAULTS_TITLE if defaults else section_title(args), body)


def section_title(args) -> str:
    """The frontier section a run writes: one per grid, per group size other than ``SECTION_GROUP_SIZE`` (W4 g128 on
    Gemma-3) and per calibration size other than ``SECTION_SAMPLES``."""
    sizes = sorted({PRECISIONS[p][1] for p in args.precisions} - {SECTION_GROUP_SIZE})
    return (TITLE + SECTION_SUFFIXES[args.grid] + (f" (group size {', '.join(map(str, sizes))})" if sizes else "")
            + (f" ({args.calib_samples} calibration samples)" if args.calib_samples != SECTION_SAMPLES else ""))


if __name__ == "__main__":
    main()
