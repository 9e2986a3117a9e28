"""Cross-check a GPTQModel run: perplexity of the tool's own packed checkpoint (--out/quantized,
run through GPTQModel's torch kernels) vs our dequantized copy (--out/dequantized, plain HF), both
in bfloat16 (GPTQModel's CPU torch kernels refuse float32). They should agree to ~0.1%; a large gap
means the dequantization (e.g. the AWQ nibble order) is wrong. gptqmodel venv:

    benchmarks/.venvs/gptqmodel/bin/python benchmarks/peers/verify_gptqmodel_kernel.py \
        --run benchmarks/.cache/runs/test-gptqmodel-awq --tokens benchmarks/.cache/heldout_8x512.pt
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from _common import perplexity

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="a run_gptqmodel.py --out dir")
    ap.add_argument("--tokens", required=True)
    args = ap.parse_args()

    import torch
    from gptqmodel import BACKEND, GPTQModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    run = Path(args.run)
    toks = torch.load(args.tokens, weights_only=True).long()
    method = json.loads((run / "result.json").read_text())["method"]
    backend = BACKEND.AWQ_TORCH if method == "awq" else BACKEND.GPTQ_TORCH
    q = GPTQModel.load(str(run / "quantized"), device="cpu", backend=backend, dtype=torch.bfloat16)
    p_kernel = perplexity(q.model, toks)
    del q
    d = AutoModelForCausalLM.from_pretrained(str(run / "dequantized"), dtype=torch.bfloat16).eval()
    p_dense = perplexity(d, toks)
    rel = abs(p_kernel - p_dense) / p_kernel
    print(f"ppl gptqmodel-kernel(bf16)={p_kernel:.4f}  dequantized-dense(bf16)={p_dense:.4f}  rel.diff={rel:.4%}")
    if rel > 0.01:
        raise SystemExit("MISMATCH: dequantized copy does not match GPTQModel's own kernel")


if __name__ == "__main__":
    main()
