"""Copy an embedded real model (SmolLM2-135M-Instruct by default, or Gemma-3 270M) as the plain float32 Hugging Face
checkpoint every peer tool (GPTQModel, llm-compressor, AutoRound) and compound read in the benchmarks: the directory
compound converts from the model's GGUF file once (``toolkit.models.embedded_model_dir``), copied beside the
benchmarks so that their commands name a path of their own.

    python benchmarks/peers/export_float.py [--model smollm2-135m] [--out benchmarks/.cache/<model>-hf]

float32: the GGUF weights are Q4_1 / Q4_K_M-dequantized values, which float32 holds exactly (bfloat16 would round
them again), and the peers compute their statistics in fp32 on CPU anyway.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from toolkit.models import EMBEDDED, embedded_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(EMBEDDED), help="the embedded model's alias")
    ap.add_argument("--out", default=None, help="default: benchmarks/.cache/<model>-hf")
    args = ap.parse_args()
    out = Path(args.out or ROOT / "benchmarks" / ".cache" / f"{args.model}-hf")
    partial = out.with_name(out.name + ".partial")  # renamed into place when whole: a killed copy leaves no `out`
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(embedded_model_dir(args.model), partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    print(f"{args.model} (float32) -> {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main()
