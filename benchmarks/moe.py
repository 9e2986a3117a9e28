"""Mixture-of-Experts calibration on a MoE with real weights: SmolLM2-135M-Instruct upcycled to Mixtral (4 experts,
top-2; ``benchmarks/moe_upcycle.py``), W4 g64, compound's RTN / GPTQ / AWQ / AWQ+GPTQ under ``--moe-calibration
routed`` and ``all``, beside GPTQModel and llm-compressor (GPTQ, AWQ) on the same checkpoint and calibration tensor.

Conventions are ``benchmarks/quantize_vs_peers.py``'s, whose helpers this reuses: asymmetric grids (RTN too), GPTQ
with act-order (static groups) for every tool, AWQ asymmetric; each tool in its own process (peers in their venvs
from ``benchmarks/peers/setup.sh``) under ``/usr/bin/time`` for wall time and peak RSS; every result scored by
compound's evaluator against the float upcycled model on the same held-out ShareGPT windows (perplexity, KL, top-1
agreement). compound's rows also give the calibration tokens each expert saw (min / median / max over the 120
experts, from the run's ``compound.json``) and how many experts fell back to round-to-nearest. RTN reads no
calibration tokens, so it runs once. Every process computes on one thread (the machine is shared).

    python benchmarks/moe.py [--methods rtn,gptq,awq,awq+gptq] [--calibration routed,all]
        [--peers gptqmodel,llmcompressor] [--samples 16] [--seq-len 512] [--windows 8] [--reuse] [--no-write]

Runs are kept under ``benchmarks/.cache/moe/runs``; ``--reuse`` takes every finished one (and the error of every
failed one) instead of running it again, and runs only what never ran.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import quantize_argv  # noqa: E402
from moe_upcycle import DEFAULT_OUT as MODEL_DIR, build  # noqa: E402
from quantize_vs_peers import VENVS, compound_config, recorded, timed  # noqa: E402
from report import cpu_name, markdown_table, update_section  # noqa: E402

from toolkit.evaluate.divergence import Divergence, divergence, paired_nll_difference  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache" / "moe"
GPTQ_OPTIONS = {"asym", "act-order"}  # quantize_vs_peers' default, for every tool
TITLE = "Mixture-of-Experts: SmolLM2 upcycled to Mixtral (4 experts, top-2)"


def failed(log: Path) -> bool:
    """Whether the run logged in ``log`` ended (its /usr/bin/time record is written; the file is created empty at the
    start, and stays empty for a killed run) — asked only when it left no finished output."""
    record = log.with_suffix(".time")
    return record.exists() and bool(record.read_text().strip())


def run_compound(method: str, moe: str | None, args, runs: Path) -> tuple[str, Path, float, float]:
    """One ``compound quantize`` run; (label, checkpoint, wall s, peak RSS MiB)."""
    label = method if moe is None else f"{method} ({moe})"
    name = f"compound-{method}" + (f"-{moe}" if moe else "")
    out, log = runs / name, runs / f"{name}.log"
    if args.reuse and (out / "config.json").exists():  # written last, by the atomic rename of the checkpoint
        return label, out, *recorded(log)
    if args.reuse and failed(log):  # ran and failed: report it, do not run it again
        raise subprocess.CalledProcessError(1, "compound quantize")
    from toolkit.engine.threads import ThreadSettings
    from toolkit.quantize import CalibrationSpec

    config = compound_config("rtn-asym" if method == "rtn" else method, GPTQ_OPTIONS, moe_calibration=moe)
    command = quantize_argv(config, CalibrationSpec(samples=args.samples, seq_len=args.seq_len),
                            ThreadSettings(threads="1"), model=MODEL_DIR, output=out)
    return label, out, *timed(command, log)


def run_peer(peer: str, method: str, calib: Path, runs: Path, reuse: bool) -> tuple[Path, float, float]:
    """One peer run in its venv (``benchmarks/peers/run_<peer>.py``); (dequantized copy, wall s, peak RSS MiB)."""
    out, log = runs / f"{peer}-{method}", runs / f"{peer}-{method}.log"
    if reuse and (out / "result.json").exists():  # the runner writes it last, after the dequantized copy
        return out / "dequantized", *recorded(log)
    if reuse and failed(log):  # ran and failed: report it, do not run it again
        raise subprocess.CalledProcessError(1, f"run_{peer}.py")
    command = [str(VENVS / peer / "bin" / "python"), str(ROOT / "benchmarks" / "peers" / f"run_{peer}.py"),
               "--model", str(MODEL_DIR), "--calib", str(calib), "--method", method, "--bits", "4",
               "--group-size", "64", "--threads", "1", "--out", str(out)]
    if method == "gptq":
        command += [f"--{option}" for option in sorted(GPTQ_OPTIONS)]
    return out / "dequantized", *timed(command, log)


def last_error(log: Path) -> str:
    """The last line of a failed run's log that names an error (else its last line)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line or line.startswith("SystemExit")]
    return (errors or lines or ["(empty log)"])[-1][:400]


def estimate_cell(out: Path) -> str:
    """The memory estimate (MiB) a compound run printed in its summary (its log beside the checkpoint)."""
    log = out.parent / f"{out.name}.log"
    found = re.search(r"^memory estimate\s+(\d+) MiB", log.read_text(errors="replace"), re.MULTILINE)
    return found.group(1) if found else "–"


def experts_cell(out: Path) -> tuple[str, str]:
    """(calibration tokens per expert min / median / max, experts rounded to nearest) from a compound checkpoint."""
    report = json.loads((out / "compound.json").read_text()).get("experts")
    if not report:
        return "–", "–"
    tokens = report["tokens_per_expert"]
    return f"{tokens['min']} / {tokens['median']} / {tokens['max']}", str(len(report["rounded_to_nearest"]))


class Replay(torch.nn.Module):
    """The float model's logits on the held-out windows, computed once and replayed to ``divergence`` for every
    quantized model (the base forward of a 375M-parameter MoE is the evaluation's other half)."""

    def __init__(self, model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 2):
        super().__init__()
        with torch.inference_mode():
            self.batches = [(b, model(input_ids=b, use_cache=False).logits) for b in windows.split(batch_size)]

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False):
        from types import SimpleNamespace

        return SimpleNamespace(logits=next(l for b, l in self.batches if torch.equal(b, input_ids)))


def findings(raw: list[dict]) -> list[str]:
    """The issue's targets: GPTQ / AWQ (and AWQ+GPTQ) each below RTN, and ``all`` calibration's perplexity increase
    at most the better peer's of the same method."""
    delta = {r["label"]: r["perplexity"] - r["base_perplexity"] for r in raw if r["tool"] == "compound"}
    lines = []
    rtn = delta.get("rtn")
    for method in ("gptq", "awq", "awq+gptq"):
        for moe in ("routed", "all"):
            label = f"{method} ({moe})"
            if label not in delta:
                continue
            line = f"- compound {label}: perplexity increase {delta[label]:+.3f}"
            if rtn is not None:
                line += (f", {'below' if delta[label] < rtn else 'NOT below'} RTN's {rtn:+.3f} "
                         f"({1 - delta[label] / rtn:.0%} less)")
            peers = [r for r in raw if r["tool"] != "compound" and r["method"] == method]
            if peers and moe == "all":
                best = min(peers, key=lambda r: r["perplexity"])
                gap = best["perplexity"] - best["base_perplexity"]
                mine = next(r for r in raw if r["tool"] == "compound" and r["label"] == label)
                d, se = paired_nll_difference(mine["window_nll"], best["window_nll"])
                line += (f"; {'at most' if delta[label] <= gap else 'ABOVE'} the better peer's ({best['tool']}, "
                         f"{gap:+.3f}); log-perplexity {d:+.4f} ± {2 * se:.4f} against it "
                         "(paired over windows, ±2 SE)")
            lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="rtn,gptq,awq,awq+gptq")
    parser.add_argument("--calibration", default="routed,all", help="--moe-calibration modes for calibrated methods")
    parser.add_argument("--peers", default="gptqmodel,llmcompressor")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--runs-only", action="store_true", help="quantize (or reuse) and stop: no scoring, for "
                        "running two halves of the methods in parallel and scoring them with a later --reuse")
    parser.add_argument("--note", default="", help="a paragraph appended to the BENCHMARKS.md section (what did "
                        "not run and why, what ran beside)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument("--reuse", action="store_true", help="take every finished run in benchmarks/.cache/moe/runs "
                        "(checkpoint or dequantized copy, and its /usr/bin/time record) and every failed one's error "
                        "instead of running it again; run only what never ran")
    args = parser.parse_args()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"  # inherited by every tool's process
    torch.set_num_threads(1)
    methods = args.methods.split(",")
    modes = list(filter(None, args.calibration.split(",")))

    from toolkit.calibration import calibration_batch, eval_windows, fingerprint
    from toolkit.models import load_model, load_tokenizer
    from toolkit.runtime.load import load_quantized

    if not (MODEL_DIR / "config.json").exists():
        build(MODEL_DIR)
    runs = CACHE / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(str(MODEL_DIR))
    # compound builds the same tensor itself (same tokenizer, source, sizes and seed 0): checked by fingerprint below
    tokens = calibration_batch(tokenizer, "sharegpt", args.samples, args.seq_len, seed=0)
    calib = CACHE / f"calib_{args.samples}x{args.seq_len}.pt"
    torch.save(tokens, calib)

    results, failures = [], []  # results: (tool, method, label, model dir, loader, seconds, rss)
    for method in methods:
        for moe in [None] if method == "rtn" else modes:
            try:
                label, out, seconds, rss = run_compound(method, moe, args, runs)
            except subprocess.CalledProcessError:
                log = runs / (f"compound-{method}" + (f"-{moe}" if moe else "") + ".log")
                failures.append(f"- compound {method} ({moe}) failed: `{last_error(log)}`")
                continue
            manifest = json.loads((out / "compound.json").read_text())
            if method != "rtn" and manifest["calibration"]["fingerprint"] != fingerprint(tokens):
                failures.append(f"- compound {method} ({moe}): calibration tokens differ from the peers' tensor")
            results.append(("compound", method, label, out, lambda d: load_quantized(d)[0], seconds, rss))
    for peer in filter(None, args.peers.split(",")):
        for method in ("gptq", "awq"):
            if method not in methods:
                continue
            if not (VENVS / peer / "bin" / "python").exists():
                failures.append(f"- {peer}: no venv; run `bash benchmarks/peers/setup.sh {peer}` first")
                break
            try:
                out, seconds, rss = run_peer(peer, method, calib, runs, args.reuse)
            except subprocess.CalledProcessError:
                failures.append(f"- {peer} {method} failed: `{last_error(runs / f'{peer}-{method}.log')}`")
                continue
            results.append((peer, method, method, out, lambda d: load_model(str(d)), seconds, rss))

    if args.runs_only:
        print("\n".join(failures) or "runs done")
        return
    windows = eval_windows(tokenizer, "sharegpt", args.windows, args.seq_len)
    base = None  # the float model's replayed logits, made when the first run needs scoring
    rows, raw = [], []
    for tool, method, label, out, loader, seconds, rss in results:
        # a run's scores on these windows are kept beside it (a checkpoint is scored once, even across invocations)
        run = out.name if tool == "compound" else out.parent.name
        scores = out.parent / f"{run}.scores-{fingerprint(windows)[:12]}.json"
        if args.reuse and scores.exists():
            d = Divergence(**json.loads(scores.read_text()))
        else:
            base = base or Replay(load_model(str(MODEL_DIR)), windows)
            model = loader(out)
            d = divergence(model, base, windows)
            del model
            scores.write_text(json.dumps(vars(d)))
        per_expert, rounded = experts_cell(out) if tool == "compound" else ("–", "–")
        estimate = estimate_cell(out) if tool == "compound" else "–"
        raw.append({"tool": tool, "method": method, "label": label, "seconds": seconds, "peak_rss_mib": rss,
                    "memory_estimate_mib": estimate, "tokens_per_expert": per_expert, "rounded_to_nearest": rounded,
                    **vars(d)})
        rows.append([tool, label, f"{seconds:.0f}", f"{rss:.0f}", estimate, f"{d.perplexity:.3f}",
                     f"{d.perplexity - d.base_perplexity:+.3f}", f"{d.kl:.4f}", f"{100 * d.top1_agreement:.1f}%",
                     per_expert, rounded])
        print(" | ".join(rows[-1]), flush=True)
    columns = ["tool", "method (calibration)", "wall s", "peak RSS MiB", "estimate MiB", "perplexity", "Δ vs float",
               "KL (nats)", "top-1 agree", "tokens per expert min / median / max", "experts RTN'd"]
    table = markdown_table(columns, rows)
    base_ppl = raw[0]["base_perplexity"] if raw else float("nan")
    left = [m for m in ("rtn", "gptq", "awq", "awq+gptq") if m not in methods]
    skipped = [f"- not in this run's `--methods`: {', '.join(left)} (`python benchmarks/moe.py --samples "
               f"{args.samples} --windows {args.windows} --reuse` runs them and keeps the finished runs above)"]
    skipped = skipped if left else []
    body = (
        f"Command: `python benchmarks/moe.py --methods {args.methods} --calibration {args.calibration or repr('')} "
        f"--peers {args.peers or repr('')} --samples {args.samples} --seq-len {args.seq_len} --windows {args.windows}"
        f"{' --reuse' if args.reuse else ''}`\n\n"
        "The model: `python benchmarks/moe_upcycle.py` copies every decoder MLP of SmolLM2-135M-Instruct (the "
        "embedded GGUF) into 4 Mixtral experts (w1 = gate_proj, w3 = up_proj, w2 = down_proj), top-2 with "
        "Mixtral's renormalised routing, and a seeded random router per layer (Gaussian rows orthogonal to the "
        "layer's mean normalised hidden state, scaled to logit std 1, so different experts win on different tokens). "
        "Attention, norms, embeddings and config values are SmolLM2's; the float model's logits equal SmolLM2's "
        "within 1e-4 (`tests/test_moe_upcycle.py`). 373M parameters in float32 (SmolLM2's 134.5M plus three more "
        "copies of every MLP), 30 MoE layers × 4 experts = 120 experts.\n\n"
        f"W4 g64 asymmetric for every method and tool (RTN too); GPTQ with act-order (static groups) for every tool. "
        f"{args.samples}×{args.seq_len} ShareGPT calibration tokens (the same tensor for every tool: compound's "
        f"fingerprint checked), {args.windows}×{args.seq_len} held-out windows ({raw[0]['tokens'] if raw else 0} "
        f"scored tokens); float perplexity {base_ppl:.3f}. Each tool in its own process on one thread, on "
        f"{cpu_name()}; "
        "what ran beside them is in the note below the table. Estimate: the memory estimate compound printed before "
        "quantizing. Tokens per expert: calibration tokens routed to each of the 120 experts "
        "(under `all` every expert also reads every other token for its statistics; the counts are the routed "
        "ones). Peers at their MoE defaults: llm-compressor linearizes transformers' fused experts itself and "
        "calibrates every expert on every token (`moe_calibrate_all_experts=True`, like compound's `all`); GPTQModel "
        "(`moe=None`) calibrates each expert on the tokens routed to it (like `routed`). compound weighs each "
        "token in an expert's statistics by the routing weight its output gets (under `all`, a token not routed to "
        "the expert by the weight it would have had); neither peer weighs them.\n\n"
        f"{table}\n\n" + "\n".join(findings(raw) + failures + skipped) + "\n\n"
        + (args.note + "\n\n" if args.note else "") +
        "Caveat: SmolLM2's weights come from a Q4_1 GGUF file (asymmetric 4-bit, groups of 32), so asymmetric RTN at "
        "g32 would recover them almost exactly. At g64 each group spans two Q4_1 groups, which flatters RTN less, but "
        "RTN's baseline here is still kinder than on a model trained in full precision."
    )
    print(body)
    (CACHE / "moe.json").write_text(json.dumps(raw, indent=2))
    if not args.no_write:
        update_section(TITLE, body)


if __name__ == "__main__":
    main()
