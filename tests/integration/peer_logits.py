"""Logits of token windows under a loader compound did not write: GPTQModel's CPU path or transformers' own
quantization integration, run with the GPTQModel venv's python (made by scripts/setup_gptqmodel.sh):

    .venvs/gptqmodel/bin/python tests/integration/peer_logits.py --loader gptqmodel|transformers --model DIR \
        --tokens windows.json --out logits.pt [--dtype float16] [--threads N]

``windows.json`` is a list of lists of token ids, each window one forward. Writes the logits, float32
[windows, tokens, vocab], to ``--out`` (``torch.save``) and prints one JSON line on stdout: {"loader", "versions",
"quantization", "modules"} where ``modules`` counts the classes of the model's quantized linears (so the test can
tell a packed kernel from a dense fallback; a Mixture-of-Experts model's per-expert linears are counted too, where
the loader keeps them as modules).

- ``gptqmodel``: ``GPTQModel.load(DIR, backend=...)`` with its plain torch kernel for the checkpoint's method
  (``gptq_torch`` / ``awq_torch``: dequantize, then matmul in the model dtype). Its CPU kernels take fp16/bf16 only.
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR)``, which reads ``quantization_config`` and hands the
  linears to its GPTQ/AWQ integration (GPTQModel's kernels underneath, selected by transformers).
"""

from __future__ import annotations

import argparse
import collections
import json
import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its CPU pool asks for (cores + 1) // 2 workers otherwise
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loader", required=True, choices=["gptqmodel", "transformers"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True, help="JSON file: list of lists of token ids")
    parser.add_argument("--out", required=True, help="where the float32 logits go (torch.save)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args(argv)

    import gptqmodel
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = json.loads(open(os.path.join(args.model, "config.json")).read())["quantization_config"]
    method = config["quant_method"]
    if args.loader == "gptqmodel":
        from gptqmodel import BACKEND, GPTQModel

        backend = BACKEND.AWQ_TORCH if method == "awq" else BACKEND.GPTQ_TORCH
        model = GPTQModel.load(args.model, device="cpu", backend=backend, dtype=dtype).model
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map="cpu")
    model.eval()

    windows = torch.tensor(json.loads(open(args.tokens).read()))
    with torch.inference_mode():
        logits = torch.stack([model(window[None]).logits[0].float() for window in windows])
    torch.save(logits, args.out)
    modules = collections.Counter(type(m).__name__ for name, m in model.named_modules()
                                  if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj", ".w1", ".w2", ".w3")))
    print(json.dumps({"loader": args.loader, "quantization": method, "modules": dict(modules),
                      "versions": {"gptqmodel": gptqmodel.__version__, "transformers": transformers.__version__,
                                   "torch": torch.__version__}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
