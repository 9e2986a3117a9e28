"""GPTQModel's CPU decode speed on a compound GPTQ checkpoint, for ``benchmarks/decode.py`` (gptqmodel venv):
greedy, batch 1, ``--new`` tokens after each prompt (prefill included), median over prompts x runs after one warm-up
run per backend, with the model in bf16 (GPTQModel's CPU int4 kernels take fp16/bf16 only). One JSON line per
backend on stdout: ``{"backend", "tokens_per_s", "tokens": [[...] per prompt]}``, or ``{"backend", "error"}`` when
a backend refuses to load.

    benchmarks/.venvs/gptqmodel/bin/python benchmarks/peers/decode_gptqmodel.py --checkpoint DIR --prompts ids.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

BACKENDS = ("gptq_torch_aten", "gptq_torch_fused", "gptq_torch")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    args = parser.parse_args()

    import torch
    from gptqmodel import BACKEND, GPTQModel

    torch.set_num_threads(args.threads)
    prompts = json.loads(open(args.prompts).read())
    for name in args.backends:
        try:
            quantized = GPTQModel.load(args.checkpoint, device="cpu", backend=BACKEND(name), dtype=torch.bfloat16)
        except Exception as e:  # a backend this CPU or checkpoint cannot take: report it, go on with the others
            print(json.dumps({"backend": name, "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
            continue
        model = quantized.model.eval()
        speeds, tokens = [], []
        for ids in prompts:
            prompt = torch.tensor([ids])
            for run in range(args.runs + 1):  # run 0 warms up
                start = time.perf_counter()
                with torch.inference_mode():
                    out = model.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
                if run:
                    speeds.append(args.new / (time.perf_counter() - start))
            tokens.append(out[0, len(ids):].tolist())
        print(json.dumps({"backend": name, "tokens_per_s": statistics.median(speeds), "tokens": tokens}), flush=True)
        del quantized, model


if __name__ == "__main__":
    main()
