"""Quantize a float HF model with llm-compressor (GPTQ or AWQ, W4 g64) on CPU and save a dequantized copy.

Run with the llmcompressor venv (benchmarks/peers/setup.sh):

    benchmarks/.venvs/llmcompressor/bin/python benchmarks/peers/run_llmcompressor.py \
        --model benchmarks/.cache/smollm2-135m-hf --calib calib.pt --method gptq \
        --bits 4 --group-size 64 --out benchmarks/.cache/runs/llmcompressor-gptq

Writes --out/result.json (times, versions, settings, grid check, ru_maxrss) and
--out/dequantized/ (plain float HF checkpoint, no quantization/compression config).

Settings: weights int4, strategy "group", group_size 64, lm_head ignored (as the W4A16 presets).
GPTQ: symmetric unless --asym, actorder=None (llm-compressor defaults to actorder="static"; turned off
unless --act-order, so that every tool orders columns the same way), dampening_frac = tool default 0.01 unless --damp, block_size 128.
AWQ: AWQModifier (defaults: duo_scaling=True, n_grid=20, default Llama mappings) followed by
QuantizationModifier with asymmetric (zero-point) int4 g64 weights - the split the deprecated
`AWQModifier(scheme="W4A16_ASYM")` shim expands to. pipeline: tool default ("independent" ->
sequential per decoder layer). The whole calibration tensor is used, unshuffled.
--rotate hadamard | random-hadamard: SpinQuantModifier(rotations=["R1", "R2"], transform_type=that) first, its
offline rotations (embeddings centred, norms fused into the linears, the residual stream and each head's values
rotated, all folded into the weights; a tied LM head is untied), so the dequantized copy stays a plain model.
"hadamard" (SpinQuant's default) builds only power-of-two sizes; "random-hadamard" also k·2^n for its known k.

The dequantized weights: for every quantized Linear, the weight is passed through
compressed-tensors' own forward_quantize (quantize->dequantize with the module's weight_scale /
weight_zero_point / g_idx); all other tensors (incl. AWQ-rescaled norms) come from the model
as the tool left it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

_T_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

args = C.parse_args("llm-compressor", rotations=("none", "hadamard", "random-hadamard"))
C.setup_threads(args.threads)
args.dtype = args.dtype or "float32"

import os  # noqa: E402
import shutil  # noqa: E402

import torch  # noqa: E402


def build_recipe():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=args.bits, type="int", strategy="group", group_size=args.group_size,
        symmetric=(args.method == "gptq" and not args.asym), dynamic=False,
    )
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    rotation = []
    if args.rotate != "none":  # the offline rotations, folded into the weights; R3/R4 would run online
        from llmcompressor.modifiers.transform import SpinQuantModifier

        rotation = [SpinQuantModifier(rotations=["R1", "R2"], transform_type=args.rotate)]
    if args.method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        kw = dict(config_groups=groups, ignore=["lm_head"], actorder="static" if args.act_order else None)
        if args.damp is not None:
            kw["dampening_frac"] = args.damp
        return [*rotation, GPTQModifier(**kw)]
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    if not torch.accelerator.is_available():
        # llmcompressor 0.14.0.1 AWQModifier._apply_smoothing pins the cached activations
        # unconditionally (cache.pin_memory(batch_index)) -> on CPU-only torch:
        # "RuntimeError: Cannot access accelerator device when none is available."
        # Pinning only speeds up host->GPU copies; make it a no-op without an accelerator.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *a, **k: None

    return [*rotation, AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def dense_state(model) -> tuple[dict[str, torch.Tensor], list[str]]:
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    sd = {}
    qnames = []
    drop_suffixes = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_global_scale",
                     "input_scale", "input_zero_point", "output_scale", "output_zero_point")
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or scheme.weights is None or not hasattr(module, "weight_scale"):
                continue
            w = module.weight.detach().float()
            wq = forward_quantize(module, w, "weight", scheme.weights)
            sd[f"{name}.weight"] = wq.float().cpu()
            qnames.append(name)
        for k, v in model.state_dict().items():
            if k.endswith(drop_suffixes) or k in sd:
                continue
            sd[k] = v.detach().float().cpu() if v.is_floating_point() else v.detach().cpu()
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return sd, qnames


def main() -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model)
    calib = C.load_calib(args.calib)

    t_import = time.perf_counter()
    import compressed_tensors
    import llmcompressor
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import_s = round(time.perf_counter() - t_import, 3)

    t_load = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    load_s = round(time.perf_counter() - t_load, 3)

    ds = Dataset.from_dict({
        "input_ids": calib.tolist(),
        "attention_mask": torch.ones_like(calib).tolist(),
    })
    recipe = build_recipe()
    t_q = time.perf_counter()
    c_q = time.process_time()
    model = oneshot(
        model=model,
        tokenizer=tok,
        dataset=ds,
        recipe=recipe,
        num_calibration_samples=calib.shape[0],
        max_seq_length=calib.shape[1],
        shuffle_calibration_samples=False,
        batch_size=1,
    )
    quantize_s = round(time.perf_counter() - t_q, 3)
    quantize_cpu_s = round(time.process_time() - c_q, 3)

    t_d = time.perf_counter()
    sd, qnames = dense_state(model)
    ddir = out / "dequantized"
    if ddir.exists():
        shutil.rmtree(ddir)
    C.save_dense(model_dir, sd, ddir, "float32", untied=args.rotate != "none" and "lm_head.weight" in sd)
    dequant_s = round(time.perf_counter() - t_d, 3)
    grid = C.grid_check(ddir, model_dir, args.bits, args.group_size)

    effective = {}
    for m in recipe:
        d = {k: v for k, v in m.model_dump().items()
             if k in ("dampening_frac", "block_size", "actorder", "duo_scaling", "n_grid", "ignore",
                      "offload_device", "config_groups")}
        effective[type(m).__name__] = d

    C.write_result(out, {
        "tool": "llmcompressor",
        "tool_version": llmcompressor.__version__,
        "compressed_tensors_version": compressed_tensors.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "method": args.method,
        "settings": {"bits": args.bits, "group_size": args.group_size, "dtype": args.dtype, "rotate": args.rotate,
                     "threads": torch.get_num_threads(), "damp_arg": args.damp,
                     "quantized_linears": len(qnames), "effective": effective},
        "calib": {"path": str(args.calib), "samples": calib.shape[0], "seq_len": calib.shape[1]},
        "wall_s": {"quantize_call": quantize_s, "import": import_s, "load": load_s,
                   "dequantize_and_save": dequant_s,
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
