"""GPTQ and AWQ on CUDA (``--device cuda``): a random-weight 1B Llama at W4 g128 (wall time, peak GPU memory), and
the same run on the CPU of a model with its widths and two of its layers, which the GPU run must match: the
method's own error per linear within 5 % of the CPU's, the weights' agreement and each linear's output error
against the CPU checkpoint reported."""

import resource
import time

import pytest
import torch
from gpu_models import GPU_REASON, LLAMA_1B, gpu_memory, random_llama, record, work_dir, write_conversations

from toolkit.quant.configs import make_config
from toolkit.quantize import CalibrationSpec, QuantizeSettings, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_REASON)]

METHODS = ("gptq", "awq")
SETTINGS = dict(format="compressed-tensors", dtype="float16")  # one layout for both methods: the same comparison


def _run(model, method: str, output, calibration: CalibrationSpec, device: str) -> dict:
    """Quantize ``model`` with ``method`` at W4 g128 on ``device``; its wall time, memory and per-linear errors."""
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = quantize(str(model), make_config(method, bits=4, group_size=128), output, calibration,
                      QuantizeSettings(**SETTINGS, device=device), overwrite=True)
    return {"wall_s": round(time.perf_counter() - started, 1), **gpu_memory(),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "errors": result.errors, "output": result.output}


def _linears(directory) -> dict[str, torch.Tensor]:
    """Float32 dequantized weight of every quantized linear of a checkpoint."""
    from toolkit.runtime.load import load_quantized
    from toolkit.runtime.quant_linear import QuantLinear

    model, _ = load_quantized(directory)
    return {name: m.dequantized_weight() for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def _agreement(cpu_dir, cuda_dir) -> dict:
    """Share of equal weight entries (an entry differs where a code, scale or zero does) and the largest relative
    output difference of a linear, ‖x(W_cuda − W_cpu)ᵀ‖ / ‖x W_cpuᵀ‖ on random x."""
    cpu, cuda = _linears(cpu_dir), _linears(cuda_dir)
    equal = total = 0
    worst = {}
    for name, W in cpu.items():
        equal += int((W == cuda[name]).sum())
        total += W.numel()
        x = torch.randn(64, W.shape[1], generator=torch.Generator().manual_seed(0))
        worst[name] = float((x @ (cuda[name] - W).t()).norm() / (x @ W.t()).norm())
    return {"weights_equal": equal / total, "max_output_difference": max(worst.values()),
            "output_difference_per_linear": worst}


@pytest.mark.parametrize("method", METHODS)
def test_cuda_matches_the_cpu(tmp_path, method):
    work = work_dir(tmp_path)
    model = random_llama(work / "llama-1b-widths-2-layers", {**LLAMA_1B, "num_hidden_layers": 2})
    calibration = CalibrationSpec(str(write_conversations(tmp_path / "chat.jsonl", 2000)), samples=8, seq_len=256)
    cpu = _run(model, method, tmp_path / "cpu", calibration, "cpu")
    cuda = _run(model, method, tmp_path / "cuda", calibration, "cuda")
    ratios = {name: cuda["errors"][name] / max(error, 1e-12) for name, error in cpu["errors"].items()}
    agreement = _agreement(cpu["output"], cuda["output"])
    record(f"agreement-{method}", {"model": "Llama-1B widths, 2 layers, W4 g128, 8x256 tokens",
                                   "cpu_wall_s": cpu["wall_s"], "cuda_wall_s": cuda["wall_s"],
                                   "error_ratio_min": min(ratios.values()), "error_ratio_max": max(ratios.values()),
                                   **{k: v for k, v in agreement.items() if k != "output_difference_per_linear"}})
    assert set(cuda["errors"]) == set(cpu["errors"])
    worse = {name: ratio for name, ratio in ratios.items() if ratio > 1.05}
    assert not worse, f"{method} on CUDA quantized these linears with more error than on the CPU: {worse}"


@pytest.mark.parametrize("method", METHODS)
def test_a_1b_llama_quantizes_on_cuda(tmp_path, method):
    work = work_dir(tmp_path)
    model = random_llama(work / "llama-1b", LLAMA_1B)
    calibration = CalibrationSpec(str(write_conversations(tmp_path / "chat.jsonl", 2000)), samples=32, seq_len=512)
    run = _run(model, method, work / f"llama-1b-{method}-w4g128", calibration, "cuda")  # decode's check reads it
    errors = run.pop("errors")
    record(f"quantize-1b-{method}", {"model": "random Llama 1.2B (Llama-3.2-1B shapes), W4 g128, 32x512 tokens",
                                     **{k: v for k, v in run.items() if k != "output"}, "linears": len(errors),
                                     "largest_error": max(errors.values())})
    assert len(errors) == 7 * LLAMA_1B["num_hidden_layers"]
    assert all(e == e and e < float("inf") for e in errors.values())
