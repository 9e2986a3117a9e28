"""Quantize a float HF model with AutoRound (Intel's SignRound, PyPI auto-round) on CPU and save a dequantized copy.

Run with the autoround venv (scripts/setup_autoround.sh):

    benchmarks/.venvs/autoround/bin/python benchmarks/peers/run_autoround.py \
        --model benchmarks/.cache/smollm2-135m-hf --calib calib.pt --method signround \
        --bits 4 --group-size 64 --asym --iters 200 --out benchmarks/.cache/frontier/.../autoround

Writes --out/result.json (times, versions, settings, grid check, ru_maxrss) and --out/dequantized/ (plain float HF
checkpoint, no quantization config).

Settings: the tool's defaults (its W4A16 scheme, lr 1/iters, batch size 8, minmax tuning, lm_head left in float) but
for what every tool is given alike: bits, group size, the grid (symmetric unless --asym), the calibration tokens
(the rows of --calib, each one sample of its length: nsamples and seqlen follow from the file) and --iters (200 is
AutoRound's default; 0 is its round-to-nearest mode, which it still refines by its own "optimized RTN" where its
defaults turn that on). device_map "cpu".

The dequantized weights: after ``quantize()`` AutoRound leaves each quantized Linear holding its quantize-dequantized
weight (its "fake" format); they are read from the model as the tool left it, and checked against the grid.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

_T_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

AUTOROUND_DEFAULT_ITERS = 200
args = C.parse_args("AutoRound", methods=("signround",), iters=AUTOROUND_DEFAULT_ITERS)
C.setup_threads(args.threads)
args.dtype = args.dtype or "float32"

import os  # noqa: E402
import shutil  # noqa: E402

import torch  # noqa: E402


def dense_state(model) -> dict[str, torch.Tensor]:
    """Every tensor of the quantized model as float32 on the CPU, without AutoRound's own scale / zero buffers; a tied
    LM head left to the embedding (the float checkpoint stores it once)."""
    extra = ("scale", "zp", "weight_scale", "weight_zero_point", "q_scale", "zero", "scales", "qzeros")
    state = {k: v.detach().float().cpu() if v.is_floating_point() else v.detach().cpu()
             for k, v in model.state_dict().items() if not k.endswith(tuple("." + e for e in extra))}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def main() -> None:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model).resolve()
    calib = C.load_calib(args.calib)
    os.chdir(out)  # AutoRound keeps its offload work space (ar_work_space/) in the working directory

    t_import = time.perf_counter()
    import auto_round
    import transformers
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import_s = round(time.perf_counter() - t_import, 3)

    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    load_s = round(time.perf_counter() - t_load, 3)

    rows = [row[None] for row in calib]  # one [1, seq_len] batch per sample: AutoRound batches its cached inputs itself
    t_q = time.perf_counter()
    c_q = time.process_time()
    rounder = AutoRound(model, tokenizer=tok, bits=args.bits, group_size=args.group_size, sym=not args.asym,
                        iters=args.iters, dataset=rows, nsamples=calib.shape[0], seqlen=calib.shape[1],
                        device_map="cpu")
    model, _ = rounder.quantize()
    quantize_s = round(time.perf_counter() - t_q, 3)
    quantize_cpu_s = round(time.process_time() - c_q, 3)

    t_d = time.perf_counter()
    ddir = out / "dequantized"
    if ddir.exists():
        shutil.rmtree(ddir)
    C.save_dense(model_dir, dense_state(model), ddir, "float32")
    dequant_s = round(time.perf_counter() - t_d, 3)
    grid = C.grid_check(ddir, model_dir, args.bits, args.group_size)

    C.write_result(out, {
        "tool": "autoround",
        "tool_version": auto_round.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "method": args.method,
        "settings": {"bits": args.bits, "group_size": args.group_size, "sym": not args.asym, "iters": args.iters,
                     "dtype": args.dtype, "threads": torch.get_num_threads()},
        "calib": {"path": str(args.calib), "samples": calib.shape[0], "seq_len": calib.shape[1]},
        "wall_s": {"quantize_call": quantize_s, "import": import_s, "load": load_s,
                   "dequantize_and_save": dequant_s, "total": round(time.perf_counter() - _T_START, 3)},
        "cpu_s": {"quantize_call": quantize_cpu_s, "total": round(time.process_time(), 3)},
        "load_avg_at_end": list(os.getloadavg()),
        "grid_check": grid,
        "dequantized_dir": str(ddir),
    })
    if not grid["grid_ok"]:
        sys.exit("grid check FAILED: the weights read back are not on the quantization grid")


if __name__ == "__main__":
    main()
