"""Side by side on SmolLM2-135M-Instruct, W4 g64: compound's RTN / GPTQ / AWQ / AWQ+GPTQ against GPTQModel and
llm-compressor, on the same 128×512 ShareGPT calibration tokens and the same held-out windows.

Each tool runs in its own process (peers in their own venvs, made by ``benchmarks/peers/setup.sh``) under
``/usr/bin/time`` for wall time and peak RSS. Every result is then scored by compound's evaluator against the float
model: perplexity, its increase, KL divergence and top-1 agreement of next-token distributions. Every tool reads the
same float32 checkpoint (the GGUF exported once by ``benchmarks/peers/export_float.py``) and holds it whole in memory
(compound's ``--stream`` would read it a layer at a time: less memory, more time; BENCHMARKS.md has both).

    python benchmarks/quantize_vs_peers.py [--methods rtn,rtn-asym,gptq,awq,awq+gptq] [--peers gptqmodel,llmcompressor]
        [--gptq asym,act-order]

``rtn`` is symmetric (the issue's baseline), ``rtn-asym`` the same grid as AWQ's. ``--gptq`` sets GPTQ's grid and
column order for every tool alike (compound, GPTQModel, llm-compressor; act-order with static groups), and the
column order of compound's AWQ+GPTQ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import quantize_argv  # noqa: E402
from report import command_line, markdown_table, update_section  # noqa: E402

from toolkit.evaluate.divergence import divergence, paired_nll_difference  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache"
VENVS = ROOT / "benchmarks" / ".venvs"
FLOAT_DIR = CACHE / "smollm2-135m-hf"


def timed(command: list[str], log: Path) -> tuple[float, float]:
    """Run ``command`` under /usr/bin/time; (wall seconds, peak RSS MiB). Output goes to ``log``."""
    with open(log, "w") as out:
        subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", str(log.with_suffix(".time")), *command], stdout=out,
                       stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    return recorded(log)


def recorded(log: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) that /usr/bin/time wrote beside ``log``."""
    seconds, kib = log.with_suffix(".time").read_text().split()[-2:]
    return float(seconds), int(kib) / 1024


def compound_config(method: str, gptq: set[str], **options):
    """compound's W4 g64 config of a benchmark method name (``rtn-asym``: RTN on the asymmetric grid); ``gptq``:
    the GPTQ options every tool gets (asym, act-order)."""
    from toolkit.quant.configs import make_config

    if method in ("rtn", "rtn-asym"):
        return make_config("rtn", bits=4, group_size=64, sym=method == "rtn", **options)
    if method == "gptq":
        options["sym"] = "asym" not in gptq
    if method in ("gptq", "awq+gptq") and "act-order" in gptq:
        options["act_order"] = True
    return make_config(method, bits=4, group_size=64, **options)


def run_compound(method: str, args, runs: Path) -> tuple[Path, float, float]:
    out = runs / f"compound-{method}"
    log = runs / f"compound-{method}.log"
    if args.reuse and (out / "config.json").exists():  # written last, by the atomic rename of the checkpoint
        return out, *recorded(log)
    from toolkit.quantize import CalibrationSpec

    command = quantize_argv(compound_config(method, args.gptq_options),
                            CalibrationSpec(samples=args.samples, seq_len=args.seq_len), model=FLOAT_DIR, output=out)
    seconds, rss = timed(command, log)
    return out, seconds, rss


def run_peer(peer: str, method: str, calib: Path, runs: Path, gptq: set[str], reuse: bool) -> tuple[Path, float, float]:
    out = runs / f"{peer}-{method}"
    log = runs / f"{peer}-{method}.log"
    if reuse and (out / "result.json").exists():  # the runner writes it last, after the dequantized copy
        return out / "dequantized", *recorded(log)
    python = VENVS / peer / "bin" / "python"
    command = [str(python), str(ROOT / "benchmarks" / "peers" / f"run_{peer}.py"), "--model", str(FLOAT_DIR),
               "--calib", str(calib), "--method", method, "--bits", "4", "--group-size", "64", "--out", str(out)]
    if method == "gptq":
        command += [f"--{option}" for option in sorted(gptq)]
    seconds, rss = timed(command, log)
    return out / "dequantized", seconds, rss


def findings(raw: list[dict]) -> list[str]:
    """The issue's targets read off the rows: each method's perplexity increase against symmetric and asymmetric
    RTN, and compound's wall time and peak memory against the faster peer of the same method."""
    delta = {(r["tool"], r["method"]): r["perplexity"] - r["base_perplexity"] for r in raw}
    lines = []
    for method in ("gptq", "awq", "awq+gptq"):
        mine = next((r for r in raw if r["tool"] == "compound" and r["method"] == method), None)
        if mine is None:
            continue
        cuts = [f"{1 - delta[('compound', method)] / delta[('compound', rtn)]:.0%} below {rtn}'s"
                for rtn in ("rtn", "rtn-asym") if ("compound", rtn) in delta]
        line = f"- compound {method}: perplexity increase {delta[('compound', method)]:.3f}, {' and '.join(cuts)}"
        peers = [r for r in raw if r["tool"] != "compound" and r["method"] == method]
        if peers:
            fastest = min(peers, key=lambda r: r["seconds"])
            best = min(peers, key=lambda r: r["perplexity"])
            line += (f"; {fastest['seconds'] / mine['seconds']:.2f}× faster than {fastest['tool']} (the faster peer), "
                     f"peak RSS {mine['peak_rss_mib'] / fastest['peak_rss_mib']:.2f}× its; perplexity "
                     f"{mine['perplexity'] - best['perplexity']:+.3f} vs {best['tool']} (the better peer), KL "
                     f"{mine['kl']:.4f} vs {best['kl']:.4f}")
            if best["window_nll"]:
                gap, se = paired_nll_difference(mine["window_nll"], best["window_nll"])
                line += (f"; log-perplexity {gap:+.4f} ± {2 * se:.4f} against it (paired over the windows, ±2 SE: "
                         f"{'within' if abs(gap) <= 2 * se else 'beyond'} the windows' noise)")
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="rtn,rtn-asym,gptq,awq,awq+gptq")
    parser.add_argument("--gptq", default="asym,act-order", help="GPTQ options for every tool: asym, act-order")
    parser.add_argument("--peers", default="gptqmodel,llmcompressor")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=80)
    parser.add_argument("--section", default="Quantization vs peers", help="the BENCHMARKS.md section written (the "
                        "symmetric-grid history of 2026-11-29 is its own section)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument("--reuse", action="store_true",
                        help="take every finished run in benchmarks/.cache/runs (checkpoint or dequantized copy, and "
                             "its /usr/bin/time record) instead of running it again; a missing run is run")
    args = parser.parse_args()
    args.gptq_options = set(filter(None, args.gptq.split(",")))

    from toolkit.calibration import calibration_batch, eval_windows
    from toolkit.models import load_model, load_tokenizer
    from toolkit.runtime.load import load_quantized

    default_gptq = args.gptq_options == {"asym", "act-order"}
    runs = CACHE / ("runs" if default_gptq else f"runs-gptq-{'-'.join(sorted(args.gptq_options)) or 'sym'}")
    runs.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer("smollm2-135m")
    calib = CACHE / f"calib_{args.samples}x{args.seq_len}.pt"
    torch.save(calibration_batch(tokenizer, "sharegpt", args.samples, args.seq_len, seed=0), calib)
    if not FLOAT_DIR.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "export_float.py")], check=True, cwd=ROOT)

    results = []  # (tool, method, model dir, loader, seconds, rss)
    failures = []
    for method in args.methods.split(","):
        out, seconds, rss = run_compound(method, args, runs)
        results.append(("compound", method, out, load_quantized, seconds, rss))
    for peer in filter(None, args.peers.split(",")):
        for method in ("gptq", "awq"):
            if method not in args.methods.split(","):
                continue
            if not (VENVS / peer / "bin" / "python").exists():
                print(f"skipping {peer}: run benchmarks/peers/setup.sh first", file=sys.stderr)
                continue
            try:
                out, seconds, rss = run_peer(peer, method, calib, runs, args.gptq_options, args.reuse)
            except subprocess.CalledProcessError:
                log = runs / f"{peer}-{method}.log"
                failures.append(f"- {peer} {method} failed: `{log.read_text().strip().splitlines()[-1]}`")
                print(f"{peer} {method} failed; see {log}", file=sys.stderr)
                continue
            results.append((peer, method, out, lambda d: (load_model(str(d)), None), seconds, rss))

    windows = eval_windows(tokenizer, "sharegpt", args.windows, args.seq_len)
    base = load_model("smollm2-135m")
    rows, raw = [], []
    for tool, method, out, loader, seconds, rss in results:
        model = loader(out)[0]
        d = divergence(model, base, windows)
        del model
        raw.append({"tool": tool, "method": method, "seconds": seconds, "peak_rss_mib": rss, **vars(d)})
        rows.append([tool, method, f"{seconds:.0f}", f"{rss:.0f}", f"{d.perplexity:.3f}",
                     f"+{d.perplexity - d.base_perplexity:.3f}", f"{d.kl:.4f}", f"{100 * d.top1_agreement:.1f}%"])
    columns = ["tool", "method", "wall s", "peak RSS MiB", "perplexity", "Δ vs float", "KL (nats)", "top-1 agree"]
    table = markdown_table(columns, rows)
    base_ppl = raw[0]["base_perplexity"] if raw else float("nan")
    body = (f"Command: `{command_line()}`\n\n"
            f"SmolLM2-135M-Instruct, W4 g64, {args.samples}×{args.seq_len} ShareGPT calibration tokens (the same file "
            f"for every tool), {args.windows}×{args.seq_len} held-out windows ({raw[0]['tokens'] if raw else 0} "
            f"scored tokens); float perplexity {base_ppl:.3f}. 2 CPU threads each. GPTQ for every tool: "
            f"{args.gptq or 'symmetric, natural column order'}.\n\n{table}\n\n" + "\n".join(findings(raw) + failures))
    print(body)
    (CACHE / "quantize_vs_peers.json").write_text(json.dumps(raw, indent=2))
    if not args.no_write:
        update_section(args.section, body)


if __name__ == "__main__":
    main()
