"""Task-level quality of SmolLM2-135M-Instruct at W4 g64, RTN / GPTQ / AWQ side by side with the float model: held-out
perplexity, KL and agreement per slice of text (prose, code, non-English, structured), the share of tokens whose KL
passes 1 nat, and the generation checks (JSON that parses, Python that compiles, facts that match).

Each method is the ``compound quantize`` command printed in the section (skipped with ``--reuse`` when its checkpoint
exists), then ``compound eval --model CKPT --base smollm2-135m`` (what a user types); the numbers come from each
run's ``eval.json``.

    python benchmarks/eval_slices.py [--methods rtn,gptq,awq] [--windows 16] [--reuse] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import compound_argv, quantize_argv  # noqa: E402
from report import command_line, cpu_name, markdown_table, update_section  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache" / "eval"
MODEL = "smollm2-135m"
SLICES = ("prose", "code", "non-english", "structured", "overall")


def quantize_command(method: str) -> list[str]:
    """W4 g64 of ``method`` on 128×512 ShareGPT calibration tokens, the same for every method."""
    from toolkit.quant.configs import make_config
    from toolkit.quantize import CalibrationSpec

    return quantize_argv(make_config(method, bits=4, group_size=64),
                         CalibrationSpec(dataset="sharegpt", samples=128, seq_len=512), model=MODEL,
                         output=checkpoint(method))


def eval_command(args, method: str) -> list[str]:
    """``compound eval`` of ``method``'s checkpoint against the float model."""
    return compound_argv("eval", model=checkpoint(method), base=MODEL, windows=args.windows, seq_len=args.seq_len,
                         new_tokens=args.new_tokens, output=f"{checkpoint(method)}.eval", overwrite=True)


def checkpoint(method: str) -> Path:
    return CACHE / f"smollm2-{method}-w4g64"


def label(method: str) -> str:
    """e.g. "GPTQ W4 g64 sym", from the checkpoint's manifest."""
    q = json.loads((checkpoint(method) / "compound.json").read_text())["quantization"]
    return f"{method.upper()} W{q['bits']} g{q['group_size']} {'sym' if q['sym'] else 'asym'}"


def shown(command: list[str]) -> str:
    return " ".join(command).replace(str(ROOT) + "/", "")


def run(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def rows(reports: dict[str, dict]) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    """(perplexity per slice, KL / top-1 / breaks per slice, generation pass rates), methods side by side."""
    first = next(iter(reports.values()))
    ppl, kl = [], []
    for name in SLICES:
        row = first["overall"] if name == "overall" else first["slices"][name]
        cells = [name, str(row["tokens"]), f"{row['base_perplexity']:.3f}"]
        kl_cells = [name]
        for report in reports.values():
            r = report["overall"] if name == "overall" else report["slices"][name]
            cells.append(f"{r['perplexity']:.3f} (×{r['perplexity_ratio']:.3f})")
            kl_cells.append(f"{r['kl']:.3f} / {r['top1_agreement']:.1%} / {r['top5_agreement']:.1%} / "
                            f"{r['kl_above']:.1%}")
        ppl.append(cells)
        kl.append(kl_cells)
    gen = []
    for name, check in first["generation"].items():
        gen.append([name, str(check["prompts"]), f"{check['passed']['base']:.0%}",
                    *(f"{r['generation'][name]['passed']['model']:.0%}" for r in reports.values())])
    gen.append(["factual, first line identical to the float model's", str(first["generation"]["factual"]["prompts"]),
                "–", *(f"{r['generation']['factual']['same_as_base']:.0%}" for r in reports.values())])
    return ppl, kl, gen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="rtn,gptq,awq")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--reuse", action="store_true", help="keep existing checkpoints instead of quantizing again")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    methods = args.methods.split(",")
    reports, seconds = {}, {}
    for method in methods:
        if not (args.reuse and (checkpoint(method) / "compound.json").is_file()):
            print(f"$ {shown(quantize_command(method))}", flush=True)
            run(quantize_command(method))
        print(f"$ {shown(eval_command(args, method))}", flush=True)
        seconds[method] = run(eval_command(args, method))
        reports[method] = json.loads((Path(str(checkpoint(method)) + ".eval") / "eval.json").read_text())
    ppl, kl, gen = rows(reports)
    names = [label(m) for m in methods]
    worst = {label(m): r["worst_slice"] for m, r in reports.items()}
    tables = [
        markdown_table(["slice", "tokens", "float", *names], ppl),
        markdown_table(["slice", *(f"{n}: KL / top-1 / top-5 / KL>1" for n in names)], kl),
        markdown_table(["generation check (greedy)", "prompts", "float", *names], gen),
    ]
    for table in tables:
        print(table, end="\n\n")
    print("degrades most:", worst)
    if args.no_write:
        return
    body = "\n\n".join([
        f"Command: `{command_line()}`",
        f"On {cpu_name()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}: per "
        "method one `compound quantize` (128×512 ShareGPT calibration tokens, the same for every method) and one "
        "`compound eval` against the float model (the embedded GGUF, dequantized). Held-out: the ShareGPT eval "
        f"split, up to {args.windows}×{args.seq_len} tokens per slice (the eval split holds only a few non-English "
        "conversations, hence its smaller count); each slice's windows hold only that slice's records.",
        "Perplexity per slice (× = ratio to the float model):", tables[0],
        "Against the float model, per token: mean KL(float ‖ W4) in nats / top-1 agreement / top-5 agreement (the "
        "float model's greedy token among the W4 model's five most likely) / share of tokens with KL above 1 nat:",
        tables[1],
        "Generation checks (`calibration/prompts/`, 8 prompts each, greedy, "
        f"{args.new_tokens} new tokens): pass rates.", tables[2],
        "Degrades most (largest perplexity ratio): " + ", ".join(f"{n}: **{s}**" for n, s in worst.items())
        + ". Eval time per method (`compound eval`, both models, all slices and checks): "
        + ", ".join(f"{m.upper()} {s:.0f} s" for m, s in seconds.items()) + ".",
    ])
    update_section("Task-level quality by slice (SmolLM2-135M-Instruct, W4 g64)", body)


if __name__ == "__main__":
    main()
