"""Peak memory of ``compound quantize`` streamed (``--stream``) and in memory, on SmolLM2 and random Llama models.

The models are those of ``benchmarks/random_llama.py`` (SmolLM2 re-saved as bf16 shards, random Llamas of
other sizes).

Each run is ``compound quantize --method gptq --bits 4 --group-size 128`` (or ``--method rtn``) in a subprocess; its
peak RSS is the one it reports (its own ``VmHWM``: ``os.wait4``'s ``ru_maxrss`` would include this process's peak,
which Linux carries into a child across fork + exec), its wall time from the clock. The output is then
loaded (``toolkit.runtime.load.load_quantized``) and decodes a few greedy tokens through ``toolkit.decode``. GPTQ on
2 CPU cores with the default 128 × 512 calibration tokens would take hours on the 3B model; the table says what
calibration each row used (group size 64 for SmolLM2, whose width 576 is not a multiple of 128).

Every run's rows are kept in ``benchmarks/memory_results.json`` (keyed by model, method and mode, with the command
that measured them), and the section in BENCHMARKS.md is the table of all of them, so runs of different sizes add up.

    python benchmarks/memory.py                 # every run of the section (PLAN), then the section
    python benchmarks/memory.py [--size smollm2|small|1b|3b] [--method gptq|rtn] [--modes stream,memory]
                                [--samples 8] [--seq-len 512] [--batch-size 8] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import quantize_argv  # noqa: E402
from random_llama import SIZES, make_model  # noqa: E402
from report import cpu_name, markdown_table, update_section  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache" / "memory"
RESULTS = ROOT / "benchmarks" / "memory_results.json"


def run_quantize(model: Path, output: Path, method: str, stream: bool, samples: int, seq_len: int,
                 batch_size: int, group_size: int) -> dict:
    """Quantize in a subprocess; its peak RSS (MiB), wall time (s) and the memory estimate it printed."""
    from toolkit.quant.configs import make_config
    from toolkit.quantize import CalibrationSpec, QuantizeSettings

    command = quantize_argv(make_config(method, bits=4, group_size=group_size),
                            CalibrationSpec(samples=samples, seq_len=seq_len),
                            QuantizeSettings(stream=stream, batch_size=batch_size), model=model, output=output)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "COLUMNS": "400"}
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = child.stdout.read()
    if child.wait() != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{log[-3000:]}")
    seconds = time.perf_counter() - started
    estimate = re.search(r"memory estimate \([a-z ]+\): ([\d.]+) GiB", log)
    peak = re.search(r"peak memory \(RSS\)\D*(\d+) MiB", log)  # the child's VmHWM: ru_maxrss would carry ours
    return {"peak_mib": float(peak.group(1)), "seconds": seconds, "estimate": estimate.group(1) if estimate else "?"}


def decode_check(output: Path, new_tokens: int = 8) -> str:
    """Load the checkpoint and decode ``new_tokens`` greedy tokens through compound's loop: 'ok, N tok/s'."""
    from toolkit.decode.generate import generate
    from toolkit.decode.model import Decoder
    from toolkit.runtime.load import load_quantized

    model, tokenizer = load_quantized(output)
    prompt = tokenizer("The capital of France is")["input_ids"]
    with torch.no_grad():
        decoder = Decoder.from_model(model, len(prompt) + new_tokens)
        decoder.prepare()  # int4 packing is load time, not decode time
        tokens, stats = generate(decoder, prompt, new_tokens)
    assert tokens.shape[0] == len(prompt) + new_tokens
    return f"ok, {stats.new_tokens / stats.total_s:.1f} tok/s"


# The section's runs (size, method, modes, samples, seq_len, batch_size): ``python benchmarks/memory.py`` makes them
# all; the 3B's GPTQ runs take one calibration sequence per layer forward, to fit beside the 3B in memory.
PLAN = (("smollm2", "gptq", "stream,memory", 8, 512, 8), ("small", "gptq", "stream,memory", 8, 512, 8),
        ("3b", "gptq", "stream,memory", 8, 512, 1), ("3b", "rtn", "stream,memory", 8, 512, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default=None, help="one model (default: every run of the section)")
    parser.add_argument("--method", choices=("gptq", "rtn"), default="gptq")
    parser.add_argument("--modes", default="stream,memory", help="comma-separated: stream, memory")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8, help="calibration sequences per layer forward")
    parser.add_argument("--no-write", action="store_true", help="print the rows, leave BENCHMARKS.md and the "
                        "results file alone")
    args = parser.parse_args()

    plan = PLAN if args.size is None else \
        [(args.size, args.method, args.modes, args.samples, args.seq_len, args.batch_size)]
    measured = {}
    for run in plan:
        measured |= measure(*run)
        if not args.no_write:  # read now and write after every run: a long plan keeps what it measured
            results = {**(json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}), **measured}
            RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    if not args.no_write:
        write_section(json.loads(RESULTS.read_text()))


def measure(size: str, method: str, modes: str, samples: int, seq_len: int, batch_size: int) -> dict:
    """Quantize ``size`` with ``method`` in each of ``modes`` and check the output decodes: the rows, by key."""
    model = make_model(size)
    disk = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    group_size = 64 if size == "smollm2" else 128
    command = (f"python benchmarks/memory.py --size {size} --method {method} --modes {modes} --samples {samples} "
               f"--seq-len {seq_len} --batch-size {batch_size}")
    measured = {}
    for mode in modes.split(","):
        output = CACHE / f"{size}-{method}-{mode}"
        run = run_quantize(model, output, method, mode == "stream", samples, seq_len, batch_size, group_size)
        calibration = "none" if method == "rtn" else f"{samples}×{seq_len}, batch {batch_size}"
        row = {"model": size, "disk_bytes": disk, "method": method, "mode": mode, "group_size": group_size,
               "calibration": calibration, "peak_mib": run["peak_mib"], "seconds": round(run["seconds"]),
               "decode": decode_check(output), "estimate_gib": run["estimate"], "command": command,
               "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name()}
        print(markdown_table(COLUMNS, [_cells(row)]), flush=True)
        measured[f"{size}/{method}/{mode}"] = row
        shutil.rmtree(output, ignore_errors=True)
    return measured


def write_section(results: dict) -> None:
    """The BENCHMARKS.md section: every row of ``results``, smallest model first."""
    rows = sorted(results.values(), key=lambda r: (r["disk_bytes"], r["method"], r["mode"] != "stream"))
    body = ("Command: `python benchmarks/memory.py`\n\nRows from `benchmarks/memory_results.json`, each measured by the command in its last column, on "
            "the CPU after its date, OMP_NUM_THREADS=1. W4 of bf16 shards (g128; g64 for SmolLM2); peak RSS as the quantize "
            "process reports it (its VmHWM); \"RSS / disk\" against the bf16 size on disk; the decode check loads "
            "the output and decodes greedily through compound's loop (8 tokens after a 6-token prompt; checks dated "
            "before 2026-12-04 counted the packing of every int4 weight, about 30 s for the 3B, in that time: the "
            "section \"Decode speed against model size\" measures decoding).\n\n"
            + markdown_table(COLUMNS, [_cells(r) for r in rows]) + _target_line(results))
    print(body)
    update_section("Quantizing models larger than memory", body)


def _target_line(results: dict) -> str:
    """Issue #11's target, judged from the rows: streamed GPTQ of the 3B model at most 1/3 of its bf16 size."""
    row = results.get("3b/gptq/stream")
    if row is None:
        return ""
    ratio = row["peak_mib"] * 2**20 / row["disk_bytes"]
    verdict = "met" if ratio <= 1 / 3 else "not met"
    return (f"\n\nTarget (streamed GPTQ W4 g128 of the 3B model at most 1/3 of its bf16 size on disk, "
            f"{row['disk_bytes'] / 3 / 2**20:.0f} MiB): {row['peak_mib']:.0f} MiB = {ratio:.3f}, {verdict}.")


def _cells(row: dict) -> list[str]:
    return [row["model"], f"{row['disk_bytes'] / 1e9:.2f} GB", f"{row['method'].upper()}, {row['mode']}",
            row["calibration"], f"{row['peak_mib']:.0f} MiB", f"{row['peak_mib'] * 2**20 / row['disk_bytes']:.2f}",
            f"{row['seconds']} s", row["decode"], row["estimate_gib"], f"`{row['command']}` ({row['date']}, {row['cpu']})"]


COLUMNS = ["model", "bf16 on disk", "method, mode", "calibration", "peak RSS", "RSS / disk", "wall time",
           "decode check", "estimate printed (GiB)", "command"]

if __name__ == "__main__":
    main()
