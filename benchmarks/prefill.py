"""Prefill from slot 0: compound's C++ decode step against the torch forward, by prompt length, on SmolLM2's W4
checkpoint (compressed-tensors RTN g64, the CPU int4 kernel this machine picks) and its float model, to place
``Decoder.torch_prefill_rows``: the prompt length from which a prefill takes the torch forward.

The C++ step saves a fixed dispatch cost per forward but its attention re-reads the cache for every row, so it wins
on short prompts and loses on long ones. Each cell is the median of ``--repeats`` prefills of the first N tokens of
one ShareGPT's held-out tokens (the eval split, chat-rendered), after one warm-up; one process, ``--threads`` torch threads.

    python benchmarks/prefill.py [--lengths 16,32,48,64,96,128,256,512] [--threads 1,2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from report import command_line, cpu_name, markdown_table, update_section  # noqa: E402

TITLE = "Prefill: C++ step against the torch forward (SmolLM2, CPU)"
CHECKPOINT = ROOT / "benchmarks" / ".cache" / "prefill-w4"


def w4_checkpoint() -> Path:
    """SmolLM2 W4 g64 RTN in compressed-tensors, written once under benchmarks/.cache."""
    if not (CHECKPOINT / "model.safetensors").exists():
        subprocess.run(["compound", "quantize", "--model", "smollm2-135m", "--method", "rtn", "--bits", "4",
                        "--group-size", "64", "--format", "compressed-tensors", "--output", str(CHECKPOINT),
                        "--overwrite"], check=True)
    return CHECKPOINT


def prompt_ids(tokenizer, length: int) -> torch.Tensor:
    """The first ``length`` held-out ShareGPT tokens (the eval split, rendered as the model's chat)."""
    from toolkit.calibration import eval_windows

    return eval_windows(tokenizer, windows=1, seq_len=length)[0]


def timed_prefill(decoder, ids: torch.Tensor, repeats: int) -> float:
    """Median seconds of a prefill of ``ids`` from slot 0 (one warm-up first)."""
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            started = time.perf_counter()
            decoder(ids, 0)
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def measure(model_name: str, lengths: list[int], threads: int, repeats: int) -> list[list[str]]:
    """Rows (model, threads, length, C++ ms, torch ms, torch/C++) for one model at ``threads``."""
    from toolkit.decode import Decoder
    from toolkit.models import load_model, load_tokenizer
    from toolkit.runtime.load import load_quantized

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer("smollm2-135m")
    model = load_model("smollm2-135m") if model_name == "float32" else load_quantized(w4_checkpoint())[0]
    decoder = Decoder.from_model(model, max(lengths) + 1)
    if decoder.native_step is None:
        raise SystemExit("the decoder's C++ step does not run on this machine: nothing to compare")
    decoder.prepare()
    rows = []
    for length in lengths:
        ids = prompt_ids(tokenizer, length)
        decoder.torch_prefill_rows = length + 1  # the C++ step
        native = timed_prefill(decoder, ids, repeats)
        decoder.torch_prefill_rows = 1  # the torch forward
        forward = timed_prefill(decoder, ids, repeats)
        rows.append([model_name, str(threads), str(length), f"{native * 1e3:.1f}", f"{forward * 1e3:.1f}",
                     f"{forward / native:.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="16,32,48,64,96,128,256,512", help="comma-separated prompt lengths")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--models", default="w4,float32", help="comma-separated, of w4, float32")
    parser.add_argument("--repeats", type=int, default=5, help="timed prefills per cell (median)")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = [row for model in args.models.split(",") for threads in map(int, args.threads.split(","))
            for row in measure(model, lengths, threads, args.repeats)]
    from toolkit.decode import Decoder

    table = markdown_table(["model", "threads", "prompt tokens", "C++ step, ms", "torch forward, ms",
                            "torch / C++"], rows)
    body = (f"{cpu_name()}, {time.strftime('%Y-%m-%d')}, nothing else running. Median of {args.repeats} prefills "
            f"from slot 0 after a warm-up. A ratio above 1: the C++ step is faster. `Decoder.torch_prefill_rows` "
            f"is {Decoder.torch_prefill_rows}.\n\n{table}\n\nCommand: `{command_line()}`")
    print(table)
    if not args.no_write:
        update_section(TITLE, body)


if __name__ == "__main__":
    main()
