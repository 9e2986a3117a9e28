"""What the INT8 KV-cache scales that ``compound quantize --kv-cache int8`` calibrates buy in compound's decode loop.

One W4 g64 RTN checkpoint of SmolLM2-135M-Instruct with INT8 KV-cache scales calibrated on ``--samples`` ×
``--seq-len`` ShareGPT tokens (static: one amax / 127 per layer, or per KV head with ``--strategy attn_head``), then
the held-out perplexity through compound's loop (every window prefilled into the cache, so each attention reads the
cache as stored) with

- a float cache (the model's dtype), the reference;
- an INT8 cache scaled per token and head as each entry is written (what ``compound decode --kv-cache-dtype int8`` does
  for a checkpoint without scales);
- an INT8 cache with the checkpoint's calibrated static scales (what it does for one with them).

A quality measurement, not a timing: it may run beside other work.

    python benchmarks/kv_cache.py [--windows 16] [--seq-len 512] [--strategy tensor] [--no-write]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import quantize_argv  # noqa: E402
from decode import loop_perplexity  # noqa: E402
from report import command_line, markdown_table, update_section  # noqa: E402

MODEL = "smollm2-135m"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--strategy", default="tensor", choices=("tensor", "attn_head"))
    parser.add_argument("--no-write", action="store_true", help="Print the table without updating BENCHMARKS.md.")
    args = parser.parse_args()

    from toolkit.calibration import eval_windows
    from toolkit.quant.configs import make_config
    from toolkit.quantize import CalibrationSpec, QuantizeSettings
    from toolkit.quant.kv_cache import int8_decode_scales
    from toolkit.runtime.load import load_quantized, read_manifest

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "w4-kv-int8"
        command = quantize_argv(make_config("rtn", bits=4, group_size=64),
                                CalibrationSpec(samples=args.samples, seq_len=args.seq_len),
                                QuantizeSettings(kv_cache="int8", kv_cache_strategy=args.strategy), model=MODEL,
                                output=checkpoint)
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        model, tokenizer = load_quantized(checkpoint, torch.float32, backend="reference")
        scales = int8_decode_scales(model, read_manifest(checkpoint))
        windows = eval_windows(tokenizer, "sharegpt", args.windows, args.seq_len)
        float_ppl = loop_perplexity(model, windows)
        per_token = loop_perplexity(model, windows, torch.int8)
        calibrated = loop_perplexity(model, windows, torch.int8, scales)

    rows = [["float (fp32)", f"{float_ppl:.3f}", "-"]]
    for name, ppl in (("INT8, per token and head (no scales in the checkpoint)", per_token),
                      (f"INT8, calibrated static scales ({args.strategy})", calibrated)):
        rows.append([name, f"{ppl:.3f}", f"{ppl - float_ppl:+.3f}"])
    table = markdown_table(["KV cache", "perplexity", "Δ vs float"], rows)
    body = (f"Command: `{command_line()}`\n\nSmolLM2-135M-Instruct W4 g64 RTN with INT8 KV-cache scales "
            f"calibrated on {args.samples}×{args.seq_len} ShareGPT tokens; held-out perplexity through compound's "
            f"decode loop on {args.windows}×{args.seq_len} tokens (eval split), the W4 linears on the dequantized "
            f"reference.\n\n{table}\n\nOne static scale per layer costs perplexity where a scale per token and head "
            f"costs none, so `compound decode --kv-cache-dtype int8` scales per token and `--kv-cache-dtype "
            f"int8-static` runs the calibrated scales (what an engine with static scales stores). Per KV head "
            f"(`--strategy attn_head`) measured the same here: the decode loop takes one scale per layer and keeps "
            f"the largest head's.\n")
    print(body)
    if not args.no_write:
        update_section("INT8 KV cache: calibrated static scales vs per-token scales (SmolLM2, decode loop)", body)


if __name__ == "__main__":
    main()
