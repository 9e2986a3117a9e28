"""Quantize a float HF model with GPTQModel (GPTQ or AWQ, W4 g64) on CPU and save a dequantized copy.

Run with the gptqmodel venv (benchmarks/peers/setup.sh):

    benchmarks/.venvs/gptqmodel/bin/python benchmarks/peers/run_gptqmodel.py \
        --model benchmarks/.cache/smollm2-135m-hf --calib calib.pt --method gptq \
        --bits 4 --group-size 64 --out benchmarks/.cache/runs/gptqmodel-gptq

Writes --out/result.json (times, versions, settings, grid check, ru_maxrss) and
--out/dequantized/ (plain float HF checkpoint, no quantization_config).

Settings: GPTQ symmetric unless --asym, desc_act=False and act_group_aware=False (GPTQModel turns its
"GAR" activation-group-aware reordering ON by default for GPTQ; we turn it off so that every tool orders
columns the same way), or with --act-order desc_act=True + static_groups=True; damp_percent = GPTQModel's default (0.05) unless --damp; AWQ asymmetric
(zero point), GEMM format. Everything else is the tool's default.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

_T_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

args = C.parse_args("GPTQModel")
C.setup_threads(args.threads)
# GPTQModel 7.6.0 AWQ in float32 on CPU gives a BROKEN model (ppl ~1e7 on SmolLM2-135M, also through
# GPTQModel's own kernel): the AWQ scales end up applied inconsistently (norm weights grow while the
# balanced linears grow too). In bfloat16 (its AwqTorchLinear's supported dtype) the scaling is
# consistent. So AWQ runs in bfloat16 unless --dtype says otherwise.
args.dtype = args.dtype or ("bfloat16" if args.method == "awq" else "float32")
# gptqmodel 7.6.0 sizes its CPU worker pool as (cpu_count+1)//2 = 1 on a 2-core machine, but its
# 'model_loader:cpu' sub-pool asks for 2 -> "ValueError: Virtual pool 'model_loader:cpu' requests
# 2 workers but parent 'cpu' only has 1". Give the parent pool 2 workers (threads, not processes).
import os  # noqa: E402

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import json  # noqa: E402
import shutil  # noqa: E402

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402


def build_config():
    from gptqmodel import AWQConfig, GPTQConfig

    if args.method == "gptq":
        kw = dict(bits=args.bits, group_size=args.group_size, sym=not args.asym, desc_act=args.act_order,
                  static_groups=args.act_order, act_group_aware=False)
        if args.damp is not None:
            kw["damp_percent"] = args.damp
        return GPTQConfig(**kw)
    return AWQConfig(bits=args.bits, group_size=args.group_size, sym=False)


def dequantize_checkpoint(qdir: Path) -> dict[str, torch.Tensor]:
    """Dense tensors from GPTQModel's packed checkpoint: every non-quant tensor as saved, plus
    `<prefix>.weight` for every packed linear.

    GPTQ: gptqmodel's own convert_gptq_file (handles the v1 qzeros offset, g_idx).
    AWQ:  unpack_awq + reverse_awq_order (gptqmodel's own AWQ unpack); gptqmodel 7.6.0's
          model_dequant.convert_awq_file does NOT undo the AWQ nibble interleave, so it is not used.
    """
    cfg = json.loads((qdir / "config.json").read_text())
    qcfg = cfg.get("quantization_config", {})
    files = sorted(qdir.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if args.method == "gptq":
        from gptqmodel.utils.model_dequant import convert_gptq_file

        for f in files:
            out.update(convert_gptq_file(f, torch.float32, qcfg, "cpu"))
        return out

    from gptqmodel.quantization.awq.utils.packing_utils import reverse_awq_order, unpack_awq

    bufs: dict[str, dict[str, torch.Tensor]] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as r:
            for k in r.keys():
                t = r.get_tensor(k)
                for suf in (".qweight", ".qzeros", ".scales"):
                    if k.endswith(suf):
                        bufs.setdefault(k[: -len(suf)], {})[suf[1:]] = t
                        break
                else:
                    out[k] = t.float() if t.is_floating_point() else t
    bits = int(qcfg.get("bits", args.bits))
    for prefix, b in bufs.items():
        iw, iz = unpack_awq(b["qweight"], b["qzeros"], bits)
        iw, iz = reverse_awq_order(iw, iz, bits)
        mask = (1 << bits) - 1
        iw = (iw & mask).float()
        iz = (iz & mask).float()
        scales = b["scales"].float()  # [in/gs, out]
        gs = iw.shape[0] // scales.shape[0]
        w = (iw - iz.repeat_interleave(gs, 0)) * scales.repeat_interleave(gs, 0)  # [in, out]
        out[prefix + ".weight"] = w.t().contiguous()
    return out


def main() -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model)
    calib = C.load_calib(args.calib)

    t_import = time.perf_counter()
    import gptqmodel
    from gptqmodel import GPTQModel
    import_s = round(time.perf_counter() - t_import, 3)

    dtype = getattr(torch, args.dtype)
    qcfg = build_config()
    t_load = time.perf_counter()
    model = GPTQModel.load(str(model_dir), qcfg, device="cpu", dtype=dtype)
    load_s = round(time.perf_counter() - t_load, 3)

    dataset = [{"input_ids": row.tolist(), "attention_mask": [1] * row.numel()} for row in calib]
    # AWQ + FORMAT.GEMM on a CPU device auto-selects BACKEND.AWQ_GEMM (CUDA-only) and fails with
    # "ValueError: AWQ: CUDA is not available."; the portable torch AWQ kernel packs the same format.
    qkw = {}
    if args.method == "awq":
        from gptqmodel import BACKEND

        qkw["backend"] = BACKEND.AWQ_TORCH
        if dtype == torch.float32:
            # AwqTorchLinear declares SUPPORTS_DTYPES=[fp16, bf16]; packing an fp32 model fails with
            # "NotImplementedError: ... AwqTorchLinear'> only supports [torch.float16, torch.bfloat16]
            # dtype: actual dtype = torch.float32". Widening the guard lets it run, but the result is
            # broken (see top of file): only for debugging, with an explicit --dtype float32.
            print("WARNING: GPTQModel AWQ in float32 is known to give a broken model here", flush=True)
            from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear

            if torch.float32 not in AwqTorchLinear.SUPPORTS_DTYPES:
                AwqTorchLinear.SUPPORTS_DTYPES = [*AwqTorchLinear.SUPPORTS_DTYPES, torch.float32]
    t_q = time.perf_counter()
    c_q = time.process_time()
    model.quantize(dataset, batch_size=1, **qkw)
    quantize_s = round(time.perf_counter() - t_q, 3)
    quantize_cpu_s = round(time.process_time() - c_q, 3)

    qdir = out / "quantized"
    if qdir.exists():
        shutil.rmtree(qdir)
    t_s = time.perf_counter()
    model.save(str(qdir))
    save_s = round(time.perf_counter() - t_s, 3)
    effective = {k: getattr(model.quantize_config, k, None) for k in (
        "bits", "group_size", "sym", "desc_act", "act_group_aware", "damp_percent",
        "damp_auto_increment", "static_groups", "mse", "true_sequential", "format", "method",
        "lm_head", "pack_dtype")}
    del model

    t_d = time.perf_counter()
    state = dequantize_checkpoint(qdir)
    ddir = out / "dequantized"
    if ddir.exists():
        shutil.rmtree(ddir)
    C.save_dense(model_dir, state, ddir, "float32")
    dequant_s = round(time.perf_counter() - t_d, 3)
    grid = C.grid_check(ddir, model_dir, args.bits, args.group_size)
    if args.drop_quantized:
        shutil.rmtree(qdir)

    import transformers

    C.write_result(out, {
        "tool": "gptqmodel",
        "tool_version": gptqmodel.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "method": args.method,
        "settings": {"bits": args.bits, "group_size": args.group_size, "dtype": args.dtype,
                     "threads": torch.get_num_threads(), "damp_arg": args.damp,
                     "effective": {k: str(v) for k, v in effective.items()}},
        "calib": {"path": str(args.calib), "samples": calib.shape[0], "seq_len": calib.shape[1]},
        "wall_s": {"quantize_call": quantize_s, "import": import_s, "load": load_s,
                   "save_packed": save_s, "dequantize_and_save": dequant_s,
                   "total": round(time.perf_counter() - _T_START, 3)},
        # CPU seconds (user+sys, all threads of this process): less sensitive than wall time to
        # other load on a shared machine
        "cpu_s": {"quantize_call": quantize_cpu_s, "total": round(time.process_time(), 3)},
        "load_avg_at_end": list(os.getloadavg()),
        "grid_check": grid,
        "dequantized_dir": str(ddir),
    })
    if not grid["grid_ok"]:
        sys.exit("grid check FAILED")


if __name__ == "__main__":
    main()
