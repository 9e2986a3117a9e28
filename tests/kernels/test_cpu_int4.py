"""toolkit.runtime.cpu_int4: compound's kernels (AVX512-BF16, AVX2-FMA) and torch's CPU int4 mm fed GPTQ/AWQ/CT
weights, against the torch oracle.

Each kernel's conversion (compound's: W = unit·scale·(bias + q)/unit − (z + bias)·scale; torch: W = (q − 8)·scale +
(8 − z)·scale) is proved by multiplying the identity: with x = I, the kernel returns W.T itself, so every weight it
reconstructs is compared, not a projection of it. Every test runs on each kernel this machine has; where the CPU has
a kernel's instruction sets, that kernel must be among them (a failed build is a failure, not a skip).
"""

import dataclasses

import pytest
import torch
from kernel_cases import make_case

from toolkit.formats import gptq as gptq_format
from toolkit.kernels import reference as R
from toolkit.quant.primitives import quantize_rtn
from toolkit.runtime import cpu_int4, native
from toolkit.runtime.cpu_int4 import int4_mm_cpu, prepare_int4_cpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# the kernels this CPU has the instruction sets for, read without building any (nothing builds at collection; the
# first test that runs one builds it, and test_compound_kernels_run_where_the_cpu_allows fails if one does not build)
NATIVE_HERE = [name for name, kernel in cpu_int4.NATIVE.items() if not native.missing_cpu_flags(kernel.build)]
HERE = [*NATIVE_HERE, "torch"]


@pytest.fixture(params=HERE)
def kernel(request):
    return request.param


@pytest.fixture(params=NATIVE_HERE)
def native_kernel(request):
    return request.param


def prepare(case, kernel):
    """Codes, scale and integer zero as every layout defines them, from the weight behind a case."""
    w = case.weight
    g_idx = w.g_idx if case.layout != "awq" else None
    return prepare_int4_cpu(w.codes, w.scale, case.zero, case.group_size, g_idx=g_idx, kernel=kernel)


def x_dtype(kernel: str) -> torch.dtype:
    """What the kernel rounds x to (torch's op: run in fp32 here, exact)."""
    return cpu_int4.NATIVE[kernel].x_dtype if kernel in cpu_int4.NATIVE else torch.float32


def reconstructed_weight(handle) -> torch.Tensor:
    """W [N, K] as the kernel sees it: I_K @ W.T (the identity is exact in bf16)."""
    return int4_mm_cpu(torch.eye(handle.K), handle, compute_dtype=x_dtype(handle.kernel)).t()


def test_compound_kernels_run_where_the_cpu_allows():
    """Each of compound's kernels builds wherever the CPU has its instruction sets, and the default is the first of
    them that runs (torch's op where none does)."""
    assert cpu_int4.available_kernels() == HERE
    assert cpu_int4.default_kernel() == HERE[0]


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize(("layout", "sym", "act_order"),
                         [("gptq", False, False), ("gptq", True, True), ("awq", False, False), ("ct", True, False),
                          ("ct", False, True)])
def test_identity_reconstructs_the_weight(layout, sym, act_order, group_size, kernel):
    """N = 40 is padded to 48; group sizes 32..128 run natively, per-channel as one group (torch: 4 sub-groups of 32)."""
    case = make_case(layout, N=40, K=128, group_size=group_size, act_order=act_order and group_size != -1, sym=sym)
    torch.testing.assert_close(reconstructed_weight(prepare(case, kernel)), case.W, rtol=1e-6, atol=1e-6)


def test_conversion_formula():
    scale, zero = torch.tensor([[0.5, 0.25]]), torch.tensor([[3, 8]])
    torch_scale, torch_zero = cpu_int4._torch_scale_and_zero(scale, zero)
    assert torch.equal(torch_scale, scale)
    assert torch_zero.tolist() == [[2.5, 0.0]]  # (8 − z)·scale; symmetric (z = 8) has no offset
    q = torch.arange(16.0).view(16, 1, 1)
    torch.testing.assert_close((q - 8) * torch_scale + torch_zero, scale * (q - zero), rtol=0, atol=1e-7)


@pytest.mark.parametrize("wrong", [lambda s, z: (s, z * s), lambda s, z: (s, -z * s), lambda s, z: (s, (8 - z).float())])
def test_a_wrong_conversion_fails(monkeypatch, wrong):
    """z·s, −z·s, or the zero left in code units: each misses the −8 of torch's convention, and the check sees it."""
    case = make_case("gptq", N=48, K=128, group_size=32)
    monkeypatch.setattr(cpu_int4, "_torch_scale_and_zero", lambda s, z: tuple(t.float() for t in wrong(s.double(), z.double())))
    assert R.max_relative_error(reconstructed_weight(prepare(case, "torch")), case.W) > 0.05


@pytest.mark.parametrize("wrong", [("bias", 0), ("bias", 1), ("unit", 1), ("unit", 8)])
def test_a_wrong_bias_or_unit_fails(monkeypatch, native_kernel, wrong):
    """The codes are read as (bias + q) / unit: an offset that removes another constant, or a scale for another unit,
    misses the weight, and the check sees it."""
    field, value = wrong
    right = cpu_int4.NATIVE[native_kernel]
    if getattr(right, field) == value:
        value += 2
    monkeypatch.setattr(cpu_int4.NativeKernel, field, property(lambda kernel: value))  # the Python side only
    case = make_case("awq", N=32, K=128, group_size=32)
    assert R.max_relative_error(reconstructed_weight(prepare(case, native_kernel)), case.W) > 0.05


def test_a_wrong_code_layout_fails(monkeypatch, native_kernel):
    """Swapping neighbouring input columns (k ↔ k + 1) is caught, so the layout, not just the sums, is checked."""
    case = make_case("gptq", N=16, K=64, group_size=32)
    right = cpu_int4.NATIVE[native_kernel]
    swapped = dataclasses.replace(right, pack=lambda codes: right.pack(codes.view(16, -1, 2).flip(-1).reshape(16, -1)))
    monkeypatch.setitem(cpu_int4.NATIVE, native_kernel, swapped)
    assert R.max_relative_error(reconstructed_weight(prepare(case, native_kernel)), case.W) > 0.05


@pytest.mark.parametrize("M", [1, 2, 3, 5, 17])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["gptq", "awq", "ct"])
def test_matches_reference(layout, dtype, M, kernel):
    """Default bf16 compute within bf16's tolerance; torch's op computing in x's own dtype within that dtype's.
    M = 1..5 and 17 cover compound's passes of 1, 2, 3 and 4 rows."""
    case = make_case(layout, N=72, K=192, group_size=64, seed=M)
    handle = prepare(case, kernel)
    x = torch.randn(M, 192, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = R.w4a16_matmul_reference(x, case.W)
    y = int4_mm_cpu(x, handle)
    assert y.dtype == dtype and y.shape == (M, 72)
    assert R.max_relative_error(y, ref) < R.TOLERANCE[torch.bfloat16]
    if kernel == "torch":
        assert R.max_relative_error(int4_mm_cpu(x, handle, compute_dtype=None), ref) < R.TOLERANCE[dtype]
    else:  # x rounded to the kernel's x dtype, the weight exact: the fp32 product of that x, to fp32 summation error
        exact = R.w4a16_matmul_reference(x.to(x_dtype(kernel)).float(), case.W)
        assert R.max_relative_error(y.float(), exact) < (1e-5 if dtype == torch.float32 else R.TOLERANCE[dtype])
        if x_dtype(kernel) == torch.float32 or dtype == x_dtype(kernel):  # x's own dtype is served as exactly
            torch.testing.assert_close(int4_mm_cpu(x, handle, compute_dtype=None), y, rtol=0, atol=0)
        else:  # a finer x than the kernel reads is refused, not silently rounded
            with pytest.raises(ValueError, match="bfloat16 only"):
                int4_mm_cpu(x, handle, compute_dtype=None)


def test_fp32_x_is_rounded_as_torch_rounds_it(native_kernel):
    """A native kernel given fp32 x rounds it to its x dtype itself: the same bits as x rounded by torch first,
    ties to even included (1 + 2⁻⁸ lies halfway between two bf16 numbers)."""
    case = make_case("gptq", N=32, K=128, group_size=64, seed=6)
    handle = prepare(case, native_kernel)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    x[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130])  # ties both ways, a subnormal
    assert torch.equal(int4_mm_cpu(x, handle), int4_mm_cpu(x.to(x_dtype(native_kernel)).float(), handle))


def test_act_order_permutes_x(kernel):
    case = make_case("gptq", N=40, K=192, group_size=32, act_order=True, seed=4)
    handle = prepare(case, kernel)
    assert handle.perm is not None
    x = torch.randn(2, 5, 192, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = int4_mm_cpu(x, handle)
    assert y.shape == (2, 5, 40)
    assert R.max_relative_error(y, R.w4a16_matmul_reference(x, case.W)) < R.TOLERANCE[torch.bfloat16]


def test_shifted_g_idx_fails(kernel):
    case = make_case("gptq", N=48, K=192, group_size=32, act_order=True, seed=5)
    w = case.weight
    wrong = prepare_int4_cpu(w.codes, w.scale, w.zero, 32, g_idx=(w.g_idx + 1) % 6, kernel=kernel)
    assert R.max_relative_error(reconstructed_weight(wrong), case.W) > 0.1
    rolled = make_case("gptq", N=48, K=128, group_size=32)
    w = rolled.weight
    off_by_one = prepare_int4_cpu(w.codes, w.scale, w.zero, 32, g_idx=w.g_idx.roll(1), kernel=kernel)
    assert R.max_relative_error(reconstructed_weight(off_by_one), rolled.W) > 10 * R.TOLERANCE[torch.float32]


def test_from_a_gptq_checkpoint(kernel):
    """The path QuantLinear will take: packed GPTQ tensors → formats.gptq.unpack → prepare → int4 mm."""
    torch.manual_seed(0)
    tensors = gptq_format.pack(quantize_rtn(torch.randn(192, 576), bits=4, group_size=64, sym=True))
    qweight = gptq_format.unpack(tensors, bits=4, group_size=64)
    handle = prepare_int4_cpu(qweight.codes, qweight.scale, qweight.zero, 64, qweight.g_idx, kernel=kernel)
    x = torch.randn(4, 576).bfloat16()
    ref = R.w4a16_matmul_reference(x, R.dequantize_gptq(**tensors))
    assert R.max_relative_error(int4_mm_cpu(x, handle), ref) < R.TOLERANCE[torch.bfloat16]


def test_group_sizes_torch_lacks(kernel):
    """96 = 3 sub-groups of 32 works; 48 (not a multiple of 32) and unequal act-order groups are refused."""
    case = make_case("awq", N=16, K=192, group_size=96)
    torch.testing.assert_close(reconstructed_weight(prepare(case, kernel)), case.W, rtol=1e-6, atol=1e-6)
    w = make_case("gptq", N=16, K=96, group_size=48).weight
    with pytest.raises(ValueError, match="multiple of 32"):
        prepare_int4_cpu(w.codes, w.scale, w.zero, 48)
    w = make_case("gptq", N=16, K=64, group_size=32).weight
    uneven = torch.cat([torch.zeros(40), torch.ones(24)]).int()
    with pytest.raises(ValueError, match="exactly 32 columns"):
        prepare_int4_cpu(w.codes, w.scale, w.zero, 32, g_idx=uneven)


def test_input_errors(kernel):
    handle = prepare(make_case("gptq", N=16, K=64, group_size=32), kernel)
    with pytest.raises(ValueError, match="K = 64"):
        int4_mm_cpu(torch.randn(2, 32), handle)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        int4_mm_cpu(torch.randn(2, 64).double(), handle)
    with pytest.raises(ValueError, match="0..15"):
        prepare_int4_cpu(torch.full((16, 64), 16, dtype=torch.uint8), torch.ones(16, 2), torch.ones(16, 2), 32)
    with pytest.raises(ValueError, match="unknown CPU int4 kernel"):
        prepare_int4_cpu(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), torch.ones(16, 2), 32, kernel="avx2")


@pytest.mark.parametrize(("N", "K", "group_size"), [(8, 256, 256), (104, 512, 128), (4096, 1024, 32)])
def test_compound_kernels_agree_with_torch_on_larger_shapes(native_kernel, N, K, group_size):
    """compound's kernel against torch's op across blocks split between threads, a partial last block and long groups."""
    case = make_case("gptq", N=N, K=K, group_size=group_size, seed=N)
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(1))
    ours, theirs = (int4_mm_cpu(x, prepare(case, k), compute_dtype=x_dtype(k)) for k in (native_kernel, "torch"))
    assert R.max_relative_error(ours, R.w4a16_matmul_reference(x.to(x_dtype(native_kernel)).float(), case.W)) < 1e-5
    assert R.max_relative_error(ours, theirs) < R.TOLERANCE[torch.bfloat16]


def test_a_row_gets_the_same_bits_alone_or_among_others(native_kernel):
    """Decoding (one row) and verification (several) must agree bit for bit for speculative decoding to stay lossless."""
    case = make_case("awq", N=40, K=256, group_size=64, seed=3)
    handle = prepare(case, native_kernel)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([int4_mm_cpu(x[i:i + 1], handle) for i in range(7)])
    for rows in (2, 3, 5, 7):
        assert torch.equal(int4_mm_cpu(x[:rows], handle), alone[:rows]), rows
