"""The Triton W4A16 kernels compiled for the GPU: every layout against the torch oracle at the decode and prefill row
counts, and the M = 1 product's bandwidth beside a device-to-device copy of the same bytes (goal: 70 % of it).

Triton is imported inside the tests only (see ``gpu_models``): without CUDA they are skipped before it is.
"""

import sys
from pathlib import Path

import pytest
import torch
from gpu_models import GPU_REASON, record

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))
from kernel_cases import LAYOUTS, make_case  # noqa: E402

from toolkit.kernels import reference as R  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_REASON)]

ROWS = (1, 2, 4, 8, 16, 64)  # split-K (decode, M <= 16) and GEMM variants
GROUP_SIZES = (32, 64, 128)
N, K = 1024, 2048
# Llama-3-8B's and Llama-3-70B's MLP up projection (K → N), where batch-1 decode spends most of its bytes
BANDWIDTH_SHAPES = ((4096, 14336), (8192, 28672))
BANDWIDTH_GOAL = 0.70


def _compiled_kernels():
    """{layout: run(tensors on the GPU, x, group_size)} for the compiled kernels (never the interpreter's)."""
    from toolkit.kernels._launch import interpreting
    from toolkit.kernels.w4a16_awq import awq_w4a16
    from toolkit.kernels.w4a16_ct import ct_w4a16
    from toolkit.kernels.w4a16_gptq import _gptq_kernel, gptq_w4a16

    if interpreting(_gptq_kernel):
        pytest.skip("TRITON_INTERPRET=1 was set when the kernels were imported: run tests/gpu in a process of its own")
    return {
        "gptq": lambda t, x, g: gptq_w4a16(x, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], g),
        "awq": lambda t, x, g: awq_w4a16(x, t["qweight"], t["qzeros"], t["scales"], g),
        "ct": lambda t, x, g: ct_w4a16(x, t["weight_packed"], t["weight_scale"], g,
                                       weight_zero_point=t.get("weight_zero_point"), g_idx=t.get("g_idx")),
    }


def test_every_layout_matches_the_reference_on_the_gpu():
    kernels = _compiled_kernels()
    errors, failures = {}, []
    for layout in LAYOUTS:
        for group_size in GROUP_SIZES:
            case = make_case(layout, N, K, group_size, seed=group_size)
            tensors = {name: t.cuda() for name, t in case.tensors.items()}
            W = case.W.cuda()
            for M in ROWS:
                x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).half().cuda()
                error = R.max_relative_error(kernels[layout](tensors, x, group_size), R.w4a16_matmul_reference(x, W))
                errors[f"{layout} g{group_size} M={M}"] = error
                if not error < R.TOLERANCE[torch.float16]:
                    failures.append(f"{layout} g{group_size} M={M}: {error:.2e}")
    record("kernels", {"device": torch.cuda.get_device_name(), "shape": f"N={N} K={K} fp16",
                       "tolerance": R.TOLERANCE[torch.float16], "max_relative_error": errors})
    assert not failures, f"above {R.TOLERANCE[torch.float16]}: {failures}"


def _random_packed(layout: str, K: int, N: int, group_size: int = 128) -> dict[str, torch.Tensor]:
    """Packed tensors of a K → N linear with random words, built on the GPU (no oracle: only the bytes matter)."""
    G = K // group_size

    def words(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device="cuda")

    def scales(*shape):
        return (0.01 * torch.rand(*shape, device="cuda")).half()

    if layout == "gptq":
        return {"qweight": words(K // 8, N), "qzeros": words(G, N // 8), "scales": scales(G, N),
                "g_idx": torch.arange(K, dtype=torch.int32, device="cuda") // group_size}
    if layout == "awq":
        return {"qweight": words(K, N // 8), "qzeros": words(G, N // 8), "scales": scales(G, N)}
    return {"weight_packed": words(N, K // 8), "weight_scale": scales(N, G), "weight_zero_point": words(N // 8, G)}


def test_decode_product_reads_at_copy_bandwidth():
    from triton.testing import do_bench

    kernels = _compiled_kernels()
    rows, short = {}, []
    for K_, N_ in BANDWIDTH_SHAPES:
        for layout in LAYOUTS:
            tensors = _random_packed(layout, K_, N_)
            x = torch.randn(1, K_, device="cuda").half()
            kernels[layout](tensors, x, 128)  # autotunes this shape once, outside the timing
            seconds = do_bench(lambda: kernels[layout](tensors, x, 128), return_mode="median") / 1e3
            moved = sum(t.nbytes for t in tensors.values()) + x.nbytes + N_ * 2  # read weights and x, write y
            source = torch.empty(moved, dtype=torch.uint8, device="cuda")
            target = torch.empty_like(source)
            copy_seconds = do_bench(lambda: target.copy_(source), return_mode="median") / 1e3
            product, copy = moved / seconds, 2 * moved / copy_seconds  # a copy reads and writes every byte
            rows[f"{layout} {K_}x{N_}"] = {"bytes": moved, "product_us": seconds * 1e6, "product_gb_s": product / 1e9,
                                           "copy_us": copy_seconds * 1e6, "copy_gb_s": copy / 1e9,
                                           "ratio": product / copy}
            if product / copy < BANDWIDTH_GOAL:
                short.append(f"{layout} {K_}x{N_}: {product / copy:.0%}")
            del tensors, source, target
    record("bandwidth", {"device": torch.cuda.get_device_name(), "goal": BANDWIDTH_GOAL, "shapes": rows})
    assert not short, f"the M = 1 product reads below {BANDWIDTH_GOAL:.0%} of copy bandwidth: {short}"
