"""Logits of token windows under a loader compound did not write: GPTQModel's CPU path or transformers' own
quantization integration, run with the GPTQModel venv's python (made by scripts/setup_gptqmodel.sh):

    .venvs/gptqmodel/bin/python tests/integration/peer_logits.py --tokens windows.json \
        --job gptqmodel|transformers DIR OUT [--job ...] [--dtype float16] [--threads N]

``windows.json`` is a list of lists of token ids, each window one forward. Every ``--job`` loads DIR with its loader
and writes the logits, float32 [windows, tokens, vocab], to OUT (``torch.save``); the jobs run one after another in
this one process (importing GPTQModel and transformers once), each with everything it prints, down to the file
descriptors, kept in ``OUT.log``. Prints one JSON line on stdout: a list with one entry per job, {"loader",
"versions", "quantization", "modules", "log"} where ``modules`` counts the classes of the model's quantized linears
(so the test can tell a packed kernel from a dense fallback; a Mixture-of-Experts model's per-expert linears are
counted too, where the loader keeps them as modules), or {"loader", "error", "log"} for a job that raised.

- ``gptqmodel``: ``GPTQModel.load(DIR, backend=...)`` with its plain torch kernel for the checkpoint's method
  (``gptq_torch`` / ``awq_torch``: dequantize, then matmul in the model dtype). Its CPU kernels take fp16/bf16 only.
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR)``, which reads ``quantization_config`` and hands the
  linears to its GPTQ/AWQ integration (GPTQModel's kernels underneath, selected by transformers).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import traceback

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its CPU pool asks for (cores + 1) // 2 workers otherwise
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

LOADERS = ("gptqmodel", "transformers")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", ".w1", ".w2", ".w3")


@contextlib.contextmanager
def output_to(path: str):
    """Everything written to stdout and stderr inside, by Python or by native code, goes to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


def logits_of(loader: str, model_dir: str, windows, dtype) -> tuple:
    """(float32 logits [windows, tokens, vocab], the checkpoint's quant_method, {module class: count})."""
    import torch
    import transformers

    config = json.loads(open(os.path.join(model_dir, "config.json")).read())["quantization_config"]
    method = config["quant_method"]
    if loader == "gptqmodel":
        from gptqmodel import BACKEND, GPTQModel

        backend = BACKEND.AWQ_TORCH if method == "awq" else BACKEND.GPTQ_TORCH
        model = GPTQModel.load(model_dir, device="cpu", backend=backend, dtype=dtype).model
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map="cpu")
    model.eval()
    with torch.inference_mode():
        logits = torch.stack([model(window[None]).logits[0].float() for window in windows])
    modules = collections.Counter(type(m).__name__ for name, m in model.named_modules() if name.endswith(PROJECTIONS))
    return logits, method, dict(modules)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", required=True, help="JSON file: list of lists of token ids")
    parser.add_argument("--job", nargs=3, action="append", required=True, metavar=("LOADER", "DIR", "OUT"),
                        help=f"LOADER ({', '.join(LOADERS)}) loads DIR; the float32 logits go to OUT (torch.save)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args(argv)
    if bad := [loader for loader, _, _ in args.job if loader not in LOADERS]:
        parser.error(f"--job: unknown loader {', '.join(bad)}; choose from {', '.join(LOADERS)}")

    import gptqmodel
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    windows = torch.tensor(json.loads(open(args.tokens).read()))
    versions = {"gptqmodel": gptqmodel.__version__, "transformers": transformers.__version__,
                "torch": torch.__version__}
    reports = []
    for loader, model_dir, out in args.job:
        log = out + ".log"
        try:
            with output_to(log):
                logits, method, modules = logits_of(loader, model_dir, windows, getattr(torch, args.dtype))
        except Exception as error:  # a loader's refusal is a result: the test compares it with the known limits
            with open(log, "a") as file:
                file.write(traceback.format_exc())
            reports.append({"loader": loader, "error": f"{type(error).__name__}: {error}", "log": log})
            continue
        torch.save(logits, out)
        reports.append({"loader": loader, "versions": versions, "quantization": method, "modules": modules,
                        "log": log})
    print(json.dumps(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
